"""Kernel dispatch: the engine calls these functions, never an implementation directly.

Each function runs its Triton kernel (`kernels.triton_*`) or its torch implementation, chosen
per call by the backend. The torch implementation is `kernels.reference` (also the test
oracle), except paged attention, which runs `kernels.torch_attention` (checked against the
oracle in tests/kernels/attention_oracle.py):

- "auto" (default): Triton for CUDA tensors, torch otherwise, except CPU tensors that the C++
  kernels take where they build (`kernels.cpu_extension`): paged attention
  (`kernels.cpu_paged_attention`) and the layer's elementwise ops (`kernels.cpu_fused_ops`),
  in float32 or bfloat16;
- "triton": always Triton. CPU tensors then run in Triton's interpreter, which triton selects
  from `TRITON_INTERPRET=1` in the environment when the kernels are first imported; without it
  `set_backend("triton")` on a machine without CUDA raises. Ray workers get the variable
  through their runtime environment (`runtime_env_vars`);
- "torch": always torch.

Inside a graph torch.compile traces, the elementwise ops are the torch references, which
Inductor fuses into code of its own (C++/OpenMP on CPU, Triton on CUDA); paged attention and the
K/V store run outside traced graphs (engine.attention_layer's custom op), so they keep their
kernels here.

triton is imported only when a Triton kernel is first needed. Shapes, dtypes and semantics are
documented on the torch implementations; the launchers (`kernels.triton_*.plan_*`) check shapes,
strides and dtypes and raise `KernelInputError` (a ValueError) for anything unsupported.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from pdcluster.kernels import (cpu_extension, cpu_fused_ops, cpu_gemm, cpu_paged_attention,
                               reference, torch_attention)

__all__ = [
    "BACKENDS",
    "decode_batches_rows",
    "fused_moe",
    "get_backend",
    "linear",
    "linear_silu_and_mul",
    "linear_by_handle",
    "pack_linear_weight",
    "paged_decode_attention",
    "paged_mla_attention",
    "paged_prefill_attention",
    "prepare",
    "rms_norm",
    "rotary_embedding",
    "runtime_env_vars",
    "set_backend",
    "silu_and_mul",
    "store_kv_cache",
    "triton_interpreted",
]

BACKENDS = ("auto", "triton", "torch")
_backend = "auto"
_modules: dict[str, ModuleType] = {}


def set_backend(backend: str) -> str:
    """Select "auto" | "triton" | "torch" for every later call in this process; returns the old one.

    Raises ValueError for an unknown name, ImportError if "triton" is asked for and triton is not
    installed, and RuntimeError if "triton" is asked for on a machine without CUDA while Triton's
    interpreter is off (TRITON_INTERPRET=1 was not set before the kernels were imported).
    """
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not torch.cuda.is_available() and not triton_interpreted():
        raise RuntimeError(
            "kernel backend 'triton' without CUDA needs Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before triton is imported (Ray workers: runtime_env env_vars, see kernels.runtime_env_vars)"
        )
    previous, _backend = _backend, backend
    return previous


def get_backend() -> str:
    return _backend


def prepare(device: str | torch.device, dtype: torch.dtype) -> None:
    """Build now what later calls on `device` in `dtype` will need, so the first forward does
    not wait for it: the C++ kernels for CPU (compiled once per machine)."""
    if _backend == "auto" and torch.device(device).type == "cpu":
        cpu_extension.available()


def runtime_env_vars(backend: str, device: str | torch.device) -> dict[str, str]:
    """Environment a worker process needs for `backend` on `device` (for Ray's runtime_env).

    {"TRITON_INTERPRET": "1"} when Triton is forced on a non-CUDA device, else {}."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and torch.device(device).type != "cuda":
        return {"TRITON_INTERPRET": "1"}
    return {}


def triton_interpreted() -> bool:
    """Whether this process's Triton kernels run in the interpreter (imports them)."""
    from pdcluster.kernels._triton_common import is_interpreted

    return is_interpreted(_triton("triton_kv_cache")._store_kv_cache_kernel)


def _triton(name: str) -> ModuleType:
    module = _modules.get(name)
    if module is None:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != "triton" and not (error.name or "").startswith("triton."):
                raise
            raise ImportError(
                "the Triton kernel backend needs the `triton` package (pip install triton); "
                "or use kernels.set_backend('torch')"
            ) from error
        _modules[name] = module
    return module


def _elementwise(triton_module: str, *tensors: torch.Tensor) -> ModuleType:
    """Where an elementwise op on these tensors runs: the Triton module, the C++ CPU ops, or
    the torch reference (always, inside a graph torch.compile traces)."""
    if torch.compiler.is_compiling():
        return reference
    if _use_triton(tensors[0]):
        return _triton(triton_module)
    if _backend == "auto" and cpu_fused_ops.supports(*tensors):
        return cpu_fused_ops
    return reference


def _use_triton(tensor: torch.Tensor) -> bool:
    if _backend == "torch":
        return False
    if _backend == "auto":
        return tensor.device.type == "cuda"
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           skinny: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ weight [out, in]^T (+ bias) -> [n, out]. `weight` is a dense tensor
    (`F.linear`) or one from `pack_linear_weight` (oneDNN's matmul); `skinny`, from
    `pack_skinny_weight`, runs batches of a few rows on the C++ skinny GEMM
    (`cpu_gemm.linear`). Every backend takes the same path: on CPU the GEMM does not depend
    on the attention backend chosen, and a dense weight alone is `F.linear` on any device."""
    return cpu_gemm.linear(x, weight, bias, skinny)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        skinny: torch.Tensor | None = None) -> torch.Tensor:
    """`silu_and_mul(linear(x, weight, bias, skinny))` for a gate | up weight [2d, in]:
    x [n, in] -> [n, d]. On the tile GEMM the activation is its epilogue
    (`cpu_gemm.linear_silu_and_mul`), so the [n, 2d] product is never written out."""
    fused = cpu_gemm.linear_silu_and_mul(x, weight, bias, skinny)
    return fused if fused is not None else silu_and_mul(linear(x, weight, bias, skinny))


def linear_qk_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   skinny: torch.Tensor | None, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, q_size: int, k_size: int,
                   head_dim: int) -> torch.Tensor:
    """A q | k | v projection with RoPE applied: `linear(x, weight, bias, skinny)` [n, out]
    whose first q_size features (q) and next k_size (k), heads of `head_dim`, are rotated at
    `positions` [n] as `rotary_embedding` rotates them. On the tile GEMM the rotation is its
    epilogue (`cpu_gemm.linear_rope`), so q and k are written once."""
    fused = cpu_gemm.linear_rope(x, weight, bias, skinny, positions, cos_sin_cache,
                                 q_size + k_size, head_dim)
    if fused is not None:
        return fused
    return rotary_embedding_qk(positions, linear(x, weight, bias, skinny), cos_sin_cache,
                               q_size, k_size, head_dim)


def rotary_embedding_qk(positions: torch.Tensor, qkv: torch.Tensor, cos_sin_cache: torch.Tensor,
                        q_size: int, k_size: int, head_dim: int) -> torch.Tensor:
    """`rotary_embedding` of the q (first q_size features) and k (next k_size) of a q | k | v
    projection's output [n, out], in place; returns qkv."""
    rows = qkv.shape[0]
    rotary_embedding(positions, qkv[:, :q_size].view(rows, -1, head_dim),
                     qkv[:, q_size:q_size + k_size].view(rows, -1, head_dim), cos_sin_cache)
    return qkv


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in the layout `linear` runs fastest on its device: a oneDNN-packed
    copy on CPU in float32 or bfloat16 (`cpu_gemm.pack`; an opaque tensor only `linear` reads),
    else `weight` itself."""
    return cpu_gemm.pack(weight) if cpu_gemm.can_pack(weight) else weight


def pack_skinny_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] packed for `linear`'s batches of a few rows on CPU
    (`cpu_gemm.pack_skinny`), or None where that kernel does not apply (CUDA, other dtypes,
    no C++ compiler); pass it to `linear` beside the weight."""
    return cpu_gemm.pack_skinny(weight) if cpu_gemm.can_pack_skinny(weight) else None


def linear_handle(weight: torch.Tensor, skinny: torch.Tensor | None = None) -> int | None:
    """For a weight from `pack_linear_weight` that torch.compile cannot trace (an opaque
    oneDNN tensor), or one with a skinny copy, the handle `linear_by_handle` names them by;
    None for a dense weight alone, which a traced graph reads directly."""
    return cpu_gemm.register(weight, skinny) if weight.is_mkldnn or skinny is not None else None


def linear_by_handle(x: torch.Tensor, handle: int, out_features: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` with the packed weight `linear_handle` named: x [n, in] -> [n, out_features],
    as one custom op (`pdcluster::packed_linear`) a compiled graph calls."""
    return torch.ops.pdcluster.packed_linear(x, handle, out_features, bias)


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k/v [T, num_kv_heads, head_dim] into paged caches at slots; -1 skipped. In place.

    See `reference.store_kv_cache`."""
    impl = _elementwise("triton_kv_cache", k, v, k_cache, v_cache)
    impl.store_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Varlen causal attention of packed new tokens over paged K/V -> [total_q, num_heads, head_dim];
    `sliding_window` W > 0 limits each query to the last W keys (the C++ CPU kernels have no
    window: such calls on CPU run torch). See `torch_attention.paged_prefill_attention`."""
    if _use_triton(q):
        return _triton("triton_paged_prefill").paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window)
    if sliding_window <= 0 and _cpu_kernel(q, k_cache):
        return cpu_paged_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                           cu_seqlens_q, seq_lens, scale)
    return torch_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                   seq_lens, scale, sliding_window)


def _cpu_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return _backend == "auto" and cpu_paged_attention.supports(q, k_cache)


def decode_batches_rows(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decode attention of these tensors runs the C++ CPU kernel, which takes all rows
    in one call and reads each sequence's K once for all its query heads (the prefill kernel
    would first copy K transposed), so a caller gains by sending a mixed batch's decode rows
    to one decode call and its chunks to one prefill call."""
    return _cpu_kernel(q, k_cache)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """One-token-per-sequence attention over paged K/V -> [num_seqs, num_heads, head_dim];
    `sliding_window` as in `paged_prefill_attention`.

    Split-K (flash-decoding) on the Triton path. See `torch_attention.paged_decode_attention`."""
    if _use_triton(q):
        return _triton("triton_paged_decode").paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)
    if sliding_window <= 0 and _cpu_kernel(q, k_cache):
        return cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                          seq_lens, scale)
    return torch_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                  scale, sliding_window)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, fused with the residual add when given -> (out, new_residual).

    See `reference.rms_norm`."""
    impl = _elementwise("triton_rms_norm", x, weight, *([] if residual is None else [residual]))
    return impl.rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [..., 2d] = gate | up -> [..., d]. See `reference.silu_and_mul`."""
    impl = _elementwise("triton_activation", x)
    return impl.silu_and_mul(x)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, H, D] and k [T, Hkv, D] in place at `positions`; returns (q, k).

    cos_sin_cache [max_position, D] = cos | sin halves. See `reference.rotary_embedding`."""
    impl = _elementwise("triton_rotary", q, k)
    return impl.rotary_embedding(positions, q, k, cos_sin_cache)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """A MoE layer's experts, grouped by expert -> [T, H] (kernels.triton_fused_moe on the
    Triton path). See `reference.fused_moe`."""
    impl = _triton("triton_fused_moe") if _use_triton(x) else reference
    return impl.fused_moe(x, w13, w2, topk_weights, topk_ids)


def paged_mla_attention(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                        v_dim: int) -> torch.Tensor:
    """MLA over a paged latent cache, in the latent space -> [total_q, num_heads, v_dim]:
    the Triton paged MLA decode kernel for an all-decode batch of CUDA tensors, torch
    otherwise. See `torch_attention.paged_mla_attention`."""
    if _use_triton(q) and q.shape[0] == seq_lens.shape[0]:
        return _triton("triton_mla_decode").paged_mla_decode(q, latent_cache, block_tables,
                                                             seq_lens, scale, v_dim)
    return torch_attention.paged_mla_attention(q, latent_cache, block_tables, cu_seqlens_q,
                                               seq_lens, scale, v_dim)
