"""The CPU decode stack (engine.cpu_decode_stack): an all-decode step's layers in one C++ call.
Its logits match transformers on a model with q/k/v biases (Qwen2) and equal the eager
forward's bit for bit; steps it does not take (a prefill chunk, layer hooks, another kernel
backend) still run the forward."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pdcluster import kernels
from pdcluster.engine import cpu_decode_stack
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.runner import ModelRunner, SequenceChunk
from pdcluster.kernels import cpu_gemm

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> tuple[ModelRunner, transformers.PreTrainedModel]:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("random_qwen2")
    hf = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random, not zero, q/k/v biases
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(path)
    runner = ModelRunner(EngineConfig(model=str(path), block_size=BLOCK_SIZE, num_kv_blocks=64,
                                      enforce_eager=True))
    from pdcluster.kernels import cpu_extension
    from tests.real_parts import require_real_part

    require_real_part("the C++ CPU extension", cpu_extension.available(), "no C++ compiler")
    if runner.cpu_decode_stack is None:
        pytest.skip("the decode stack does not apply here (see engine.cpu_decode_stack.build)")
    return runner, hf


def _hf_logits(hf: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _decode_against_hf_and_the_forward(runner: ModelRunner, hf: transformers.PreTrainedModel,
                                       seed: int) -> int:
    """Greedy decode steps of 3 sequences over scattered blocks, each step run on the stack and
    again on the forward: their logits are equal bit for bit and within 1e-4 of transformers.
    -> the stack's forward calls."""
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (5, 12, 9)]
    order = list(range(64))
    rng.shuffle(order)
    tables = [order[i * 8:(i + 1) * 8] for i in range(len(prompts))]  # scattered blocks
    sequences = [list(p) for p in prompts]
    logits = runner.execute([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)])
    stack, diffs, calls = runner.cpu_decode_stack, [], []
    real = stack.forward
    stack.forward = lambda *args: calls.append(len(args[0])) or real(*args)
    try:
        for _ in range(2 * BLOCK_SIZE + 1):  # decode rows cross block boundaries
            for seq, row in zip(sequences, logits):
                seq.append(int(row.argmax()))
            chunks = [SequenceChunk(s[-1:], len(s) - 1, t) for s, t in zip(sequences, tables)]
            logits = runner.execute(chunks)
            runner.cpu_decode_stack = None  # the same step again on the forward: same K/V, slots
            try:
                forward = runner.execute(chunks)
            finally:
                runner.cpu_decode_stack = stack
            assert torch.equal(logits, forward)
            diffs += [(logits[i] - _hf_logits(hf, s)[-1]).abs().max().item()
                      for i, s in enumerate(sequences)]
    finally:
        del stack.forward
    assert max(diffs) <= 1e-4
    return len(calls)


def test_decode_steps_match_hf_and_the_forward_bit_for_bit(qwen2):
    runner, hf = qwen2
    assert _decode_against_hf_and_the_forward(runner, hf, seed=3) == 2 * BLOCK_SIZE + 1


def test_batches_above_the_skinny_rows_run_onednn_inside_the_stack(qwen2, monkeypatch):
    """With the skinny GEMM limited to 2 rows, 3-row steps still run on the stack, through
    oneDNN's packed weights called from C++, and equal the forward's (oneDNN there too)."""
    runner, hf = qwen2
    monkeypatch.setattr(cpu_gemm, "skinny_max_rows", lambda dtype: 2)
    monkeypatch.setattr(cpu_decode_stack, "skinny_max_rows", lambda dtype: 2)
    stack = cpu_decode_stack.build(runner.model, runner.kv_cache)
    assert stack.packed and stack.takes(3)
    monkeypatch.setattr(runner, "cpu_decode_stack", stack)
    assert _decode_against_hf_and_the_forward(runner, hf, seed=4) == 2 * BLOCK_SIZE + 1
    # at this model's widths oneDNN and the skinny GEMM give equal bits, so count the op:
    # the dispatcher records the stack's calls as it does Python's
    chunks = [SequenceChunk([7], 3, [50]), SequenceChunk([8], 3, [51]), SequenceChunk([9], 0, [52])]
    with torch.profiler.profile() as prof:
        runner.execute(chunks)
    names = [event.name for event in prof.events()]
    assert names.count("mkldnn::_linear_pointwise") == 4 * len(runner.model.model.layers) + 1


class _Recorder:
    def __init__(self) -> None:
        self.layers: list[int] = []

    def wait_for_layer_load(self, layer: int) -> None:
        self.layers.append(layer)

    def save_kv_layer(self, layer: int) -> None:
        pass


def test_steps_the_stack_does_not_take_run_the_forward(qwen2, monkeypatch):
    runner, hf = qwen2
    prompt = [1, 17, 33, 250, 9, 80]
    runner.execute([SequenceChunk(prompt, 0, [40, 41])])
    calls = []
    real = runner.cpu_decode_stack.forward
    monkeypatch.setattr(runner.cpu_decode_stack, "forward",
                        lambda *args: calls.append(len(args[0])) or real(*args))
    decode = [SequenceChunk([prompt[-1]], len(prompt) - 1, [40, 41])]
    runner.layer_hooks = recorder = _Recorder()
    try:
        runner.execute(decode)  # a prefill worker's step: hooks around every layer
    finally:
        runner.layer_hooks = None
    assert recorder.layers == list(range(3)) and calls == []
    previous = kernels.set_backend("torch")
    try:
        runner.execute(decode)
    finally:
        kernels.set_backend(previous)
    assert calls == []
    got = runner.execute(decode + [SequenceChunk(prompt[:3], 0, [42])])  # mixed: the forward
    assert calls == []
    torch.testing.assert_close(got[0], _hf_logits(hf, prompt)[-1], atol=1e-4, rtol=0)
    runner.execute(decode)
    assert calls == [1]
