"""`pdcluster serve --model DIR` on the factory's tiny random checkpoints
(tests/models/factory.py) through the real openai client: greedy tokens equal transformers'
on the same weights, for each family beyond Llama's module (Qwen2 is Llama's module with
biases, checked against transformers in tests/engine/test_model_families.py), over a different
path each: disaggregated on every KV transfer (torch, mooncake; grpc below), colocated, tensor
parallel (TP=2 prefill and decode), and for MLA's latent blocks the pool (grpc) and layer
streaming; FP8 and compressed-tensors checkpoints too, against transformers running the
weights their format's own tools dequantize. The paths themselves carry no model-specific
code; what differs per family is the model module, the block's bytes and the kernels each
family's layers pick."""

from __future__ import annotations

import random
import signal

import pytest
from openai import OpenAI

from tests.models.factory import build, compress_checkpoint, quantize_fp8, reference_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
#: id -> (family, config overrides, serve flags)
CASES = {
    "mistral-window-torch": ("mistral", {"sliding_window": 16},
                             ["--pd-decider", "always", "--kv-transfer", "torch"]),
    "qwen3-mooncake": ("qwen3", {}, ["--pd-decider", "always", "--kv-transfer", "mooncake"]),
    "mixtral-colocated": ("mixtral", {}, ["--colocated"]),
    "qwen3_moe-tp2": ("qwen3_moe", {}, ["--pd-decider", "always", "--tensor-parallel-size", "2"]),
    # MLA: latent blocks ([layers, 1, block, 1, latent + rope]) through the KV pool, and
    # streamed layer by layer
    "deepseek_v2-grpc": ("deepseek_v2", {}, ["--pd-decider", "always"]),
    "deepseek_v2-layer": ("deepseek_v2", {}, ["--pd-decider", "always", "--kv-streaming", "layer"]),
    # each rank's rows of each part of the checkpoint's stacked q|k|v and gate|up
    "phi3-tp2": ("phi3", {}, ["--pd-decider", "always", "--tensor-parallel-size", "2"]),
    # sandwich norms and per-head q/k norms on each rank's heads
    "gemma3-tp2": ("gemma3", {}, ["--pd-decider", "always", "--tensor-parallel-size", "2"]),
    # an FP8 checkpoint (tests.models.factory.quantize_fp8), each rank widening its rows or
    # columns of each weight by their block scales; MLA's and the experts' weights over grpc
    "llama-fp8-tp2": ("llama", {}, ["--pd-decider", "always", "--tensor-parallel-size", "2"]),
    "deepseek_v2-fp8-grpc": ("deepseek_v2", {}, ["--pd-decider", "always"]),
    # a compressed-tensors INT4 checkpoint (packed, group scales and zero points): each rank
    # slicing the weight the library decompresses
    "qwen3_moe-w4a16-tp2": ("qwen3_moe", {}, ["--pd-decider", "always",
                                              "--tensor-parallel-size", "2"]),
}
#: how a case id's quantized checkpoint is made from `build`'s: `-fp8-` or `-w4a16-` in the id
QUANTIZE = {
    "fp8": lambda hf, path: quantize_fp8(path),
    "w4a16": lambda hf, path: compress_checkpoint(hf, path, {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 16,
        "symmetric": False}}),
}


#: `--full-matrix`: every family over every path (about 12 minutes), the suite's cases above
#: being one path each
PATHS = {"grpc": ["--pd-decider", "always", "--kv-transfer", "grpc"],
         "torch": ["--pd-decider", "always", "--kv-transfer", "torch"],
         "mooncake": ["--pd-decider", "always", "--kv-transfer", "mooncake"],
         "layer": ["--pd-decider", "always", "--kv-streaming", "layer"],
         "colocated": ["--colocated"],
         "tp2": ["--pd-decider", "always", "--tensor-parallel-size", "2"]}
FAMILY_OVERRIDES = {"llama": {}, "qwen2": {}, "mistral": {"sliding_window": 16}, "qwen3": {},
                    "mixtral": {}, "qwen3_moe": {}, "deepseek_v2": {},
                    "deepseek_v3": {}, "phi3": {}, "smollm3": {}, "granite": {},
                    "olmo2": {}, "olmo3": {},
                    "gemma2": {}, "gemma3": {}, "gemma3_mm": {}}
#: families that refuse tensor parallel (their q/k norms span every head)
NO_TP = {"olmo2", "olmo3"}
FULL_MATRIX = {f"{family}-{path}": (family, overrides, flags)
               for family, overrides in FAMILY_OVERRIDES.items()
               for path, flags in PATHS.items() if not (path == "tp2" and family in NO_TP)}
FULL_MATRIX.update({f"llama-{q}-{path}": ("llama", {}, flags)
                    for q in ("fp8", "w4a16") for path, flags in PATHS.items()})


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = FULL_MATRIX if metafunc.config.getoption("full_matrix") else CASES
        metafunc.parametrize("case", sorted(cases))


def test_served_greedy_output_equals_transformers(case, serve_process, tmp_path):
    family, overrides, flags = {**CASES, **FULL_MATRIX}[case]
    path = tmp_path / family
    hf = build(family, path, **overrides)
    for name, quantize in QUANTIZE.items():
        if f"-{name}-" in case:
            hf = quantize(hf, path)
    proc, port, log = serve_process("--model", str(path), "--num-kv-blocks", "256", *flags)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        rng = random.Random(case)
        # one prompt inside a block, one of several blocks (past a 16-token window)
        for length in (7, 45):
            prompt = [1] + [rng.randrange(3, 512) for _ in range(length - 1)]
            out = client.completions.create(
                model=path.name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            got = out.choices[0].model_extra["token_ids"]
            assert got == reference_greedy(hf, prompt, NEW_TOKENS), (case, length)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
