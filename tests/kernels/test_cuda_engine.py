"""The engine on a CUDA device, eager and compiled: the bundled model's greedy tokens equal
transformers' greedy generate on CPU, and its logits agree with transformers' float32 logits.

The batch is `_greedy_child.greedy`'s: a chunked prefill over a cached prefix, a varlen prefill
and decode steps that cross a block boundary, so every Triton attention path runs. Marked `gpu`;
skipped without CUDA (CI has none).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels._greedy_child import greedy  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_TOKENS = 12
PROMPTS = ["Once upon a time, there was a little girl", "The dog"]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_cuda_greedy_matches_hf(hf, enforce_eager):
    prompts = [hf.encode(text) for text in PROMPTS]
    tokens, logits = greedy(prompts, NUM_TOKENS, device="cuda", dtype="float32",
                            enforce_eager=enforce_eager)
    assert tokens == [hf.greedy(prompt, NUM_TOKENS) for prompt in prompts]
    # the first step's logits are those of each prompt's last token
    for row, prompt in zip(logits[0], prompts):
        expected = hf.logits(prompt)[-1]
        assert row.device.type == "cuda"
        assert (row.cpu() - expected).abs().max().item() <= 1e-3


def test_cuda_bfloat16_logits_near_float32(hf):
    """bf16 weights and cache, fp32 accumulation: relative L2 error of the prefill logits
    against transformers' float32 ones stays at bf16 rounding (under 3e-2)."""
    prompts = [hf.encode(text) for text in PROMPTS]
    _, logits = greedy(prompts, 1, device="cuda", dtype="bfloat16", enforce_eager=True)
    for row, prompt in zip(logits[0], prompts):
        expected = hf.logits(prompt)[-1]
        error = (row.float().cpu() - expected).norm() / expected.norm()
        assert torch.isfinite(row).all() and error.item() < 3e-2


def test_cuda_graphs_replay_decode_steps_with_the_forwards_tokens(hf, monkeypatch):
    """Decode steps of 3 sequences replay the graph of 4 (one padding row); tokens equal
    transformers' and logits those of the same runner config without graphs. A prefill longer
    than the input buffers reallocates them; the next decode steps capture again and stay
    right."""
    from engine.config import EngineConfig
    from engine.runner import ModelRunner

    prompts = [hf.encode(text) for text in PROMPTS + ["A big red ball"]]
    config = dict(device="cuda", num_kv_blocks=32, block_size=16, enforce_eager=False,
                  max_num_batched_tokens=32)
    graphs = ModelRunner(EngineConfig(**config, max_cudagraph_capture_size=8))
    plain = ModelRunner(EngineConfig(**config, max_cudagraph_capture_size=0))
    assert graphs.decode_graphs.sizes == (1, 2, 4, 8) and plain.decode_graphs is None
    replays = []
    replay = graphs.decode_graphs.replay
    monkeypatch.setattr(graphs.decode_graphs, "replay", lambda size: replays.append(size) or replay(size))

    tokens, logits = greedy(prompts, NUM_TOKENS, runner=graphs)
    plain_tokens, plain_logits = greedy(prompts, NUM_TOKENS, runner=plain)
    assert replays == [4] * (NUM_TOKENS - 1)
    assert tokens == plain_tokens == [hf.greedy(prompt, NUM_TOKENS) for prompt in prompts]
    for a, b in zip(logits, plain_logits):
        assert (a - b).abs().max().item() <= 1e-3

    # prefill chunks of 40 tokens outgrow the 32-token buffers: the graphs are stale, then
    # captured again
    long_prompt = (prompts[0] * 10)[:80]
    tokens, _ = greedy([long_prompt], 4, runner=graphs)
    assert tokens == [hf.greedy(long_prompt, 4)] and replays[-3:] == [1, 1, 1]
    assert not graphs.decode_graphs.stale
