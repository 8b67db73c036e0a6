"""benchmarks/solo_ttft.py without servers: its prompts, which must never hit a prefix cache."""

from __future__ import annotations

from benchmarks import solo_ttft as bench


def test_prompts_have_the_lengths_and_share_no_block():
    sent = bench.requests([512, 1024], 3, 32, seed=1) + bench.requests([512], 2, 32, seed=2)
    assert [len(r.prompt) for r in sent] == [512] * 3 + [1024] * 3 + [512] * 2
    assert all(r.output_len == 32 for r in sent)
    vocab = bench.FULL["vocab_size"]
    assert all(3 <= t < vocab for r in sent for t in r.prompt)  # no special id
    first_blocks = {tuple(r.prompt[:16]) for r in sent}
    assert len(first_blocks) == len(sent)
