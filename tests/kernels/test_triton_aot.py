"""Ahead-of-time compile of every kernel specialization the engine launches, for sm_90, on CPU.

`tests.kernels.aot.engine_launches` plans the launches of one forward (the same `plan_*` code the
kernels run, GPU tile configs) and `triton.compile` takes each down to a cubin for
GPUTarget("cuda", 90, 32): code that only the interpreter accepts, or a tile config that needs
more shared memory than an H100/H200 block has, fails here without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.real_parts import import_real_part

import_real_part("triton", "Triton", "scripts/setup.sh installs it on Linux")

from pdcluster import kernels  # noqa: E402
from pdcluster.engine.config import BUNDLED_MODEL  # noqa: E402
from pdcluster.engine.model_config import ModelConfig

if kernels.triton_interpreted():
    pytest.skip("AOT compilation needs TRITON_INTERPRET unset", allow_module_level=True)

from tests.kernels.aot import SM90_MAX_SHARED_BYTES, ModelShape, compile_launch, engine_launches  # noqa: E402

_BUNDLED = ModelConfig.from_pretrained(BUNDLED_MODEL)
SHAPES = {
    # the bundled stories260K (head_dim 8, GQA 2) in each serving dtype, default block size
    **{
        f"stories260K-{str(dtype).removeprefix('torch.')}": ModelShape.from_model_config(_BUNDLED, dtype, 16)
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
    },
    # Llama-3-8B heads (32 / 8, head_dim 128): the benchmark shapes, and fp32 with block 32
    "llama3-8b-bf16": ModelShape(32, 8, 128, 4096, 14336, torch.bfloat16, 16),
    "llama3-8b-fp32-block32": ModelShape(32, 8, 128, 4096, 14336, torch.float32, 32),
    # head_dim 64 without GQA, fp16, block 32
    "hd64-mha-fp16-block32": ModelShape(16, 16, 64, 1024, 2816, torch.float16, 32),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_engine_kernels_compile_for_sm90(shape):
    launches = engine_launches(shape)
    names = {launch.name for launch in launches}
    assert names == {
        "_store_kv_cache_kernel", "_prefill_kernel", "_decode_kernel", "_decode_reduce_kernel",
        "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel",
    }
    assert {launch.constexprs.get("SPLIT") for launch in launches if launch.name == "_decode_kernel"} == {False, True}
    for launch in launches:
        compiled = compile_launch(launch)
        what = f"{launch.name} {launch.constexprs}"
        assert compiled.asm.get("cubin"), f"{what}: no cubin"
        assert ".target sm_90" in compiled.asm["ptx"], what
        assert compiled.metadata.shared <= SM90_MAX_SHARED_BYTES, f"{what}: {compiled.metadata.shared} B shared memory"
