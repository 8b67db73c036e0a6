"""Sampling: greedy is argmax; seeded sampling depends only on (seed, step, logits);
processors follow vLLM's definitions, checked against direct computations."""

import math

import pytest
import torch

from pdcluster.engine.protocol import SamplingParams
from pdcluster.engine.sampler import SampleInput, apply_penalties, filter_probs, sample, step_seed


def rows(params, seeds, outputs=None, prompt=(1,)):
    outputs = outputs or [()] * len(seeds)
    return [SampleInput(params, s, prompt, o) for s, o in zip(seeds, outputs)]


def tokens(result):
    return [t for t, _ in result]


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
    assert tokens(sample(logits, rows(SamplingParams(temperature=0.0), [1, 2]))) == [1, 0]


def test_seeded_token_does_not_depend_on_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(6, 512)
    hot = SamplingParams(temperature=1.3, top_p=0.9, top_k=50)
    outs = [tuple(range(i)) for i in range(6)]  # different steps per row
    alone = [tokens(sample(logits[i:i + 1], rows(hot, [42 + i], [outs[i]])))[0] for i in range(6)]
    batched = tokens(sample(logits, rows(hot, [42 + i for i in range(6)], outs)))
    reordered = tokens(sample(logits.flip(0), rows(hot, [42 + i for i in reversed(range(6))],
                                                   outs[::-1])))
    assert alone == batched == list(reversed(reordered))


def test_different_steps_and_seeds_give_different_streams():
    logits = torch.zeros(1, 512)  # uniform: every draw is the stream's own randomness
    hot = SamplingParams(temperature=1.0)
    by_step = {tokens(sample(logits, rows(hot, [3], [tuple(range(t))])))[0] for t in range(50)}
    by_seed = {tokens(sample(logits, rows(hot, [s])))[0] for s in range(50)}
    assert len(by_step) > 30 and len(by_seed) > 30
    assert len({step_seed(1, t) for t in range(1000)}) == 1000
    assert all(0 <= step_seed(s, t) < 2**63 for s in (0, 2**63 - 1) for t in (0, 10**9))


def test_sampled_frequencies_follow_softmax_of_scaled_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -9.0]])
    params = SamplingParams(temperature=0.5)
    counts = torch.zeros(4)
    for seed in range(4000):
        counts[tokens(sample(logits, rows(params, [seed])))[0]] += 1
    expected = torch.softmax(logits[0] / 0.5, dim=-1) * 4000
    assert torch.all((counts - expected).abs() <= 4 * expected.sqrt() + 2)


def test_top_k_top_p_min_p_keep_the_expected_sets():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    kept = lambda **kw: (filter_probs(probs[None], [SamplingParams(**kw)])[0] > 0).nonzero().flatten().tolist()  # noqa: E731
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.7) == [0, 1]        # 0.4 + 0.3 reaches 0.7
    assert kept(top_p=0.71) == [0, 1, 2]
    assert kept(min_p=0.5) == [0, 1]        # >= 0.5 * 0.4
    out = filter_probs(probs[None], [SamplingParams(top_k=3)])[0]
    assert torch.allclose(out, torch.tensor([0.4, 0.3, 0.15, 0, 0]) / 0.85)


def test_penalties_follow_vllm_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits.clone(), p, prompt_ids=[0], output_ids=[1, 1, 2])
    # token 0: prompt only -> 2/2; token 1: twice in output -> -1*2 - 0.5*2 - 0.25;
    # token 2: once -> 0.5/2 - 0.5 - 0.25; token 3 untouched
    assert torch.allclose(out, torch.tensor([1.0, -3.25, -0.5, 3.0]))


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]])
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    assert tokens(sample(logits, rows(p, [0], [()]), eos_token_ids={2})) == [4]
    assert tokens(sample(logits, rows(p, [0], [(4, 4)]), eos_token_ids={2})) == [2]


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    p = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5)
    [(token, lp)] = sample(logits, rows(p, [0]))
    z = math.log(sum(math.exp(x) for x in (1.0, 2.0, 0.5)))
    assert token == 1 and lp.token_id == 1
    assert lp.logprob == pytest.approx(2.0 - z, abs=1e-6)
    assert [t for t, _ in lp.top] == [1, 0]
    assert lp.top[1][1] == pytest.approx(1.0 - z, abs=1e-6)


def test_logit_bias_adds_to_the_logits_before_the_penalties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    greedy = SamplingParams(temperature=0.0, logit_bias=((0, 2.5), (1, -100.0)))
    assert tokens(sample(logits, rows(greedy, [0]))) == [0]  # 3.5 > 2.0 > 0.5 > -97
    # vLLM biases first: token 0 seen in the prompt -> (1 + 2.5) / 2 = 1.75 < 2.0 (after: 3.0)
    penalized = SamplingParams(temperature=0.0, logit_bias=((0, 2.5), (1, -100.0)),
                               repetition_penalty=2.0)
    assert tokens(sample(logits, rows(penalized, [0], prompt=(0,)))) == [2]
    hot = SamplingParams(temperature=1.0, logit_bias=((3, 100.0),))
    assert {tokens(sample(logits, rows(hot, [s])))[0] for s in range(50)} == {3}


def test_allowed_token_ids_leave_only_those_tokens():
    torch.manual_seed(0)
    logits = torch.randn(1, 64)
    allowed = (5, 9, 40)
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    want = max(allowed, key=lambda t: logits[0, t].item())
    assert tokens(sample(logits, rows(greedy, [0]))) == [want]
    hot = SamplingParams(temperature=2.0, allowed_token_ids=allowed + (10**6,))  # past vocab
    drawn = {tokens(sample(logits, rows(hot, [s])))[0] for s in range(200)}
    assert drawn == set(allowed)


def test_bad_words_mask_their_last_token_after_their_prefix():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0]])
    p = SamplingParams(temperature=0.0, bad_words_token_ids=((1,), (3, 2)))
    assert tokens(sample(logits, rows(p, [0], [()]))) == [2]  # (1,) is always banned
    assert tokens(sample(logits, rows(p, [0], [(4, 3)]))) == [3]  # output ends with 3: no 2
    assert tokens(sample(logits, rows(p, [0], [(3, 4)]))) == [2]
    # a migrated request's earlier output (the prompt's tail) counts as output
    moved = SamplingParams(temperature=0.0, bad_words_token_ids=((3, 1),), output_offset=1)
    assert tokens(sample(logits, [SampleInput(moved, 0, (0, 3), ())])) == [2]
    assert tokens(sample(logits, [SampleInput(moved, 0, (3, 0), ())])) == [1]
    logprobbed = SamplingParams(temperature=0.0, logprobs=0, bad_words_token_ids=((1,),))
    [(token, lp)] = sample(logits, rows(logprobbed, [0]))
    assert token == 2 and lp.logprob < math.log(0.5)  # raw: token 2 is not the likeliest


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0),
                                 dict(top_p=1.5), dict(top_k=-2), dict(min_p=2),
                                 dict(presence_penalty=3), dict(repetition_penalty=0),
                                 dict(logprobs=21), dict(min_tokens=5, max_tokens=4),
                                 dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),)),
                                 dict(allowed_token_ids=()), dict(bad_words_token_ids=((),))])
def test_invalid_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-40, max_tokens=1),  # logits / T overflow to inf
    SamplingParams(temperature=1.0, top_p=1e-46, max_tokens=1),  # top_p mass underflows to 0
    SamplingParams(temperature=1.0, repetition_penalty=5e-324, max_tokens=1),  # to +-inf
])
def test_degenerate_settings_still_pick_the_mode(params):
    """Settings at the edge of float32 never fail a request: the distribution collapses to its
    most likely token (what the limit of the setting means)."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5]])
    want = tokens(sample(apply_penalties(logits[0].clone(), params, [1], [])[None],
                         rows(SamplingParams(temperature=0.0), [7])))
    assert tokens(sample(logits, rows(params, [7], prompt=(1,)))) == want


def _one_row_at_a_time(raw, row, eos_token_ids):
    """The sampler as written per row with torch.multinomial: every processor on one [vocab]
    row, then one draw from the row's (seed, step) generator."""
    p = row.params
    prompt_ids, output_ids = row.history()
    logits = apply_penalties(raw.clone(), p, prompt_ids, output_ids)
    if len(row.output_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        logits[list(banned)] = float("-inf")
    if p.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    if 0 < p.top_k < probs.numel():
        probs = torch.where(probs < torch.topk(probs, p.top_k).values[-1],
                            torch.zeros_like(probs), probs)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p * sorted_probs.sum()
        drop[0] = False
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    gen = torch.Generator().manual_seed(step_seed(row.seed, len(output_ids)))
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def test_batched_sampler_draws_what_one_row_at_a_time_draws():
    """A batch mixing greedy, temperature, min_p, top_k, top_p, penalties, min_tokens and a
    migrated request samples, row for row, the token torch.multinomial draws from that row
    alone with the same (seed, step) generator: seeded outputs do not depend on batching."""
    import random
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    vocab, eos = 2048, {7}
    choices = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.3, top_k=40),
               dict(temperature=1.0, top_p=0.8), dict(temperature=0.9, min_p=0.05),
               dict(temperature=1.1, top_k=200, top_p=0.95, min_p=0.01),
               dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5),
               dict(temperature=0.8, top_p=0.9, frequency_penalty=1.0, min_tokens=3),
               dict(temperature=1.0, top_k=vocab + 5), dict(temperature=0.6, output_offset=2)]
    for _ in range(8):
        batch = []
        for _ in range(48):
            kw = rng.choice(choices)
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 12))]
            output = tuple(rng.randrange(vocab) for _ in range(rng.randrange(0, 6)))
            batch.append(SampleInput(SamplingParams(max_tokens=64, **kw), rng.getrandbits(63),
                                     prompt, output))
        logits = torch.randn(len(batch), vocab, generator=gen) * 4
        got = tokens(sample(logits, batch, eos))
        want = [_one_row_at_a_time(logits[i], r, eos) for i, r in enumerate(batch)]
        assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_processor_runs_on_cuda_logits():
    """The engine samples on its own device: greedy rows with every edit pick on CUDA what
    they pick on CPU; seeded rows stay batch-invariant and inside their allowed ids."""
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    greedy = SamplingParams(temperature=0.0, logprobs=2, logit_bias=((7, 5.0),),
                            bad_words_token_ids=((3,), (8, 11)), repetition_penalty=1.3,
                            frequency_penalty=0.5, presence_penalty=0.2, min_tokens=3,
                            stop_token_ids=(9,))
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=(1, 50, 120))
    hot = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01,
                         allowed_token_ids=tuple(range(0, 300, 3)), logit_bias=((6, 3.0),))
    batch = [SampleInput(greedy, 1, (5, 6), (7, 8)), SampleInput(allowed, 2, (1,), ()),
             SampleInput(hot, 3, (1,), (4,)), SampleInput(hot, 4, (2,), ())]
    cpu = sample(logits, batch, {2})
    cuda = sample(logits.cuda(), batch, {2})
    assert tokens(cuda[:2]) == tokens(cpu[:2])
    assert cuda[0][1].logprob == pytest.approx(cpu[0][1].logprob, abs=1e-5)
    alone = [tokens(sample(logits[i:i + 1].cuda(), [batch[i]], {2}))[0] for i in (2, 3)]
    assert alone == tokens(cuda[2:]) and all(t % 3 == 0 for t in alone)
