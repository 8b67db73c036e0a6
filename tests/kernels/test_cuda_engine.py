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
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.runner import ModelRunner

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


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_cuda_moe_and_mla_families_compile_capture_and_match_transformers(family, tmp_path):
    """A Mixtral and a DeepSeek-V2 (MLA + MoE) tiny random model on CUDA, compiled, decode
    steps replayed from CUDA graphs: every step's logits are transformers' float32 ones on CPU
    at the same positions (the experts are a custom op, their grouping sync-free)."""
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.runner import ModelRunner
    from tests.engine.test_paged_logits import _prompt
    from tests.models.factory import BASE, build

    hf = build(family, tmp_path)
    runner = ModelRunner(EngineConfig(model=str(tmp_path), device="cuda", num_kv_blocks=16,
                                      block_size=16, enforce_eager=False,
                                      max_cudagraph_capture_size=8))
    assert runner.forward_mode == "compiled" and runner.decode_graphs is not None
    prompts = [_prompt(61, 13, BASE["vocab_size"]), _prompt(62, 7, BASE["vocab_size"])]
    tokens, logits = greedy(prompts, NUM_TOKENS, runner=runner)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt + tokens[i]])).logits[0].float()
        # step s's row i predicts token s, at position len(prompt) - 1 + s
        got = torch.stack([step[i].float().cpu() for step in logits])
        diff = (got - expected[len(prompt) - 1:len(prompt) - 1 + NUM_TOKENS]).abs().max().item()
        print(f"{family}: prompt {i}, {NUM_TOKENS} steps, max abs diff {diff:.2e}")
        assert diff <= 1e-3
