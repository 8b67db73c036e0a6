"""Sampling: greedy is argmax; seeded sampling depends only on (seed, step, logits)."""

import torch

from engine.protocol import SamplingParams
from engine.sampler import sample, step_seed


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy, greedy], [1, 2], [0, 0]) == [1, 0]


def test_seeded_token_does_not_depend_on_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(6, 512)
    hot = SamplingParams(temperature=1.3)
    alone = [sample(logits[i:i + 1], [hot], [42 + i], [7])[0] for i in range(6)]
    batched = sample(logits, [hot] * 6, [42 + i for i in range(6)], [7] * 6)
    reordered = sample(logits.flip(0), [hot] * 6, [42 + i for i in reversed(range(6))], [7] * 6)
    assert alone == batched == list(reversed(reordered))


def test_different_steps_and_seeds_give_different_streams():
    logits = torch.zeros(1, 512)  # uniform: every draw is the stream's own randomness
    hot = SamplingParams(temperature=1.0)
    by_step = {sample(logits, [hot], [3], [t])[0] for t in range(50)}
    by_seed = {sample(logits, [hot], [s], [0])[0] for s in range(50)}
    assert len(by_step) > 30 and len(by_seed) > 30
    assert len({step_seed(1, t) for t in range(1000)}) == 1000
    assert all(0 <= step_seed(s, t) < 2**63 for s in (0, 2**63 - 1) for t in (0, 10**9))


def test_sampled_frequencies_follow_softmax_of_scaled_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -9.0]])
    params = SamplingParams(temperature=0.5)
    counts = torch.zeros(4)
    for seed in range(4000):
        counts[sample(logits, [params], [seed], [0])[0]] += 1
    expected = torch.softmax(logits[0] / 0.5, dim=-1) * 4000
    assert torch.all((counts - expected).abs() <= 4 * expected.sqrt() + 2)
