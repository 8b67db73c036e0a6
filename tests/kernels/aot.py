"""Ahead-of-time compilation of the engine's kernel launches for a GPU target, without a GPU
(the test_triton_aot check; the product never compiles ahead of time).

`engine_launches` builds the `Launch` records the engine issues for one model shape (the same
`plan_*` functions the kernels call, fed small CPU tensors with the engine's dtypes, head
counts, head_dim and block_size, and the GPU tile configs); `compile_launch` turns one into
`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`, specialized the way Triton's
JIT specializes a launch (ints equal to 1 become constants, 16-divisible ints and 16-byte
aligned pointers get `tt.divisibility`). ptxas ships in the triton wheel, so this runs down to
a cubin on a CPU-only machine: code that only the interpreter accepts fails here.

Needs TRITON_INTERPRET unset (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget

from pdcluster.kernels._triton_common import Launch, is_interpreted
from pdcluster.kernels.triton_activation import plan_silu_and_mul
from pdcluster.kernels.triton_kv_cache import plan_store_kv_cache
from pdcluster.kernels.triton_paged_decode import plan_paged_decode_attention
from pdcluster.kernels.triton_paged_prefill import plan_paged_prefill_attention
from pdcluster.kernels.triton_rms_norm import plan_rms_norm
from pdcluster.kernels.triton_rotary import plan_rotary_embedding

H100_TARGET = GPUTarget("cuda", 90, 32)
SM90_MAX_SHARED_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90

_TORCH_TO_TRITON = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass(frozen=True)
class ModelShape:
    """What the kernels specialize on: heads, head_dim, widths, dtype and the cache block size."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype
    block_size: int

    @classmethod
    def from_model_config(cls, config: Any, dtype: torch.dtype, block_size: int) -> "ModelShape":
        """From an `engine.model_config.ModelConfig` (or anything with its field names)."""
        return cls(
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.hidden_size,
            config.intermediate_size,
            dtype,
            block_size,
        )


def _specialize(value: Any) -> tuple[str, Any, bool]:
    """(signature type, constant or None, 16-divisible) as Triton's JIT specializes an argument."""
    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TO_TRITON[value.dtype], None, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "u1", None, False
    if isinstance(value, int):
        if value == 1:
            return "constexpr", 1, False
        kind = "i32" if -(2**31) <= value < 2**31 else "i64"
        return kind, None, value % 16 == 0
    if isinstance(value, float):
        return "fp32", None, False
    raise TypeError(f"cannot specialize a kernel argument of type {type(value).__name__}")


def compile_launch(launch: Launch, target: GPUTarget = H100_TARGET) -> Any:
    """Compile `launch`'s kernel specialization for `target` -> triton's CompiledKernel."""
    kernel = launch.kernel
    if is_interpreted(kernel):
        raise RuntimeError("AOT compilation needs TRITON_INTERPRET unset: these kernels were built for the interpreter")
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, name in enumerate(kernel.arg_names):
        if name in launch.constexprs:
            signature[name] = "constexpr"
            constexprs[name] = launch.constexprs[name]
            continue
        if name not in launch.args:
            raise KeyError(f"{launch.name}: no value for parameter {name!r}")
        kind, constant, divisible = _specialize(launch.args[name])
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = constant
        elif divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages, **launch.options}
    return triton.compile(source, target=target, options=options)


def engine_launches(shape: ModelShape, num_tokens: int = 48, num_seqs: int = 3) -> list[Launch]:
    """Every kernel launch the engine issues for `shape`, planned for a GPU on small CPU tensors.

    One forward of a mixed batch: store_kv_cache, prefill attention, decode attention without
    and with split-K (the reduce kernel), rms_norm with and without residual, rotary, silu_and_mul.
    """
    torch.manual_seed(0)
    dtype, head_dim, block_size = shape.dtype, shape.head_dim, shape.block_size
    per_seq = num_tokens // num_seqs
    # Long enough block tables that decode with 2 splits keeps 2 (split_size rounds to BLOCK_N).
    blocks_per_seq = max(-(-(per_seq + block_size) // block_size), -(-256 // block_size))
    num_blocks = num_seqs * blocks_per_seq
    cache = torch.zeros(num_blocks, block_size, shape.num_kv_heads, head_dim, dtype=dtype)
    k = torch.zeros(num_tokens, shape.num_kv_heads, head_dim, dtype=dtype)
    q = torch.zeros(num_tokens, shape.num_heads, head_dim, dtype=dtype)
    slot_mapping = torch.arange(num_tokens, dtype=torch.int64)
    positions = torch.arange(num_tokens, dtype=torch.int64)
    block_tables = torch.arange(num_blocks, dtype=torch.int32).view(num_seqs, -1)
    cu_seqlens_q = torch.arange(0, num_tokens + 1, per_seq, dtype=torch.int32)[: num_seqs + 1]
    seq_lens = torch.full((num_seqs,), per_seq + block_size, dtype=torch.int32)
    hidden = torch.zeros(num_tokens, shape.hidden_size, dtype=dtype)
    weight = torch.ones(shape.hidden_size, dtype=dtype)
    gate_up = torch.zeros(num_tokens, 2 * shape.intermediate_size, dtype=dtype)
    cos_sin_cache = torch.zeros(4 * num_tokens, head_dim, dtype=torch.float32)
    scale = head_dim**-0.5
    gpu = "gpu"
    decode_q = q[:num_seqs]
    return [
        *plan_store_kv_cache(k, k, cache, cache.clone(), slot_mapping, target=gpu),
        *plan_paged_prefill_attention(
            q, cache, cache.clone(), block_tables, cu_seqlens_q, seq_lens, scale, target=gpu
        )[0],
        *plan_paged_decode_attention(decode_q, cache, cache.clone(), block_tables, seq_lens, scale, num_splits=1,
                                     target=gpu)[0],
        *plan_paged_decode_attention(decode_q, cache, cache.clone(), block_tables, seq_lens, scale, num_splits=2,
                                     target=gpu)[0],
        *plan_rms_norm(hidden, weight, 1e-5, target=gpu)[0],
        *plan_rms_norm(hidden, weight, 1e-5, residual=hidden.clone(), target=gpu)[0],
        *plan_rotary_embedding(positions, q, k, cos_sin_cache, target=gpu),
        *plan_silu_and_mul(gate_up, target=gpu)[0],
    ]
