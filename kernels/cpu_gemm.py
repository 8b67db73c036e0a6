"""The linear layer's GEMM on CPU: oneDNN with weights packed once, at load, and for decode
batches our skinny GEMM (`cpu_skinny_gemm.cpp`) over a second copy packed in column tiles.

`F.linear` on CPU calls BLAS with the weight in its plain [out, in] layout, and BLAS then
re-blocks the weight on every call; at decode batch sizes that traffic, not arithmetic, sets
the step time, and on some CPUs the BLAS kernel chosen is far from the machine's peak even for
prefill-sized batches. oneDNN can reorder a weight into its own blocked layout once, and its
matmul then streams that layout at close to the memory bandwidth for a few rows and near the
FMA peak for many (docs/notes/cpu-gemm-findings.md, "oneDNN-packed linear weights"). vLLM's CPU
backend packs its linear weights the same way; Inductor's freezing pass does it for bf16.

A packed weight is an opaque mkldnn tensor (`is_mkldnn`), [out, in] in shape only: it is read
by `linear` here and nothing else, so the embedding table a tied lm_head shares is packed as a
copy.

With few rows a GEMM is a read of the weight, and oneDNN's matmul does not stream its layout
at the machine's read bandwidth there on every CPU; the skinny GEMM does
(docs/notes/cpu-gemm-findings.md, "A skinny GEMM for decode"). Up to `SKINNY_MAX_ROWS` rows
`linear` takes the skinny copy where one was packed, above it oneDNN: prefill-sized batches
are compute-bound, where oneDNN's blocking for the caches pays. Both copies are kept, so the
linear weights take twice their size in memory.

bfloat16 on a CPU with AMX is the exception: there the second copy is the tile GEMM's
(`cpu_amx_gemm.cpp`, on torch's brgemm), which multiplies on the tile unit. It reads a decode
batch's weights faster than both the skinny GEMM and oneDNN, and up to about a thousand rows
it splits the work evenly over the threads where oneDNN leaves one waiting
(docs/notes/cpu-gemm-findings.md, "Prefill GEMMs on AMX tiles"), so it takes every batch up to
`AMX_MAX_ROWS` rows and oneDNN the larger ones. `pack_skinny` makes that copy, a flat tensor
the tile GEMM reads (`is_amx_copy`), and `linear` and the C++ decode stack tell the two kinds
of copy apart by its shape.

torch.compile cannot trace an opaque tensor (it has no storage to fake), so a compiled graph
names a packed weight by an integer handle (`register`) and calls the custom op
`pdcluster::packed_linear`, which looks the weight up when the graph runs.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref

import torch

from pdcluster.kernels import cpu_extension

_PACKED_DTYPES = (torch.float32, torch.bfloat16)

#: the most rows `linear` runs on the skinny copy: decode batches. It measured faster than
#: oneDNN's matmul up to this size and beyond on an AVX2 CPU (benchmarks/RESULTS.md); larger
#: batches stay on oneDNN, which ran near the FMA peak in prefill on an AVX-512 CPU
SKINNY_MAX_ROWS = 32
#: for bfloat16 on a CPU with AMX, the most rows the tile GEMM's copy takes: it beat oneDNN
#: at every size from 1 row to 1088 but for 192-384 rows; above 1088 rows oneDNN splits its
#: work differently and won (docs/notes/cpu-gemm-findings.md, "Prefill GEMMs on AMX tiles"). A
#: colocated step of a 1024-token prefill budget plus its decode rows stays below it.
AMX_MAX_ROWS = 1088


@functools.cache
def skinny_max_rows(dtype: torch.dtype) -> int:
    """The most rows `linear` runs on the second copy (`pack_skinny`) in `dtype` on this CPU:
    `AMX_MAX_ROWS` for bfloat16 where that copy is the tile GEMM's (`uses_amx_gemm`),
    `SKINNY_MAX_ROWS` otherwise."""
    return AMX_MAX_ROWS if uses_amx_gemm(dtype) else SKINNY_MAX_ROWS


@functools.cache
def uses_amx_gemm(dtype: torch.dtype) -> bool:
    """Whether `pack_skinny` packs `dtype` weights for the tile GEMM: bfloat16 on a CPU with
    AMX, with the C++ extension built and torch's brgemm running there."""
    return (dtype == torch.bfloat16 and has_amx() and cpu_extension.available()
            and cpu_extension.module().amx_gemm_supported())


def is_amx_copy(copy: torch.Tensor) -> bool:
    """Whether a `pack_skinny` copy is the tile GEMM's (flat) rather than the skinny GEMM's
    (3-D column tiles)."""
    return copy.dim() == 1


@functools.cache
def has_amx() -> bool:
    """Whether this CPU has AMX tiles and torch's oneDNN runs bfloat16 on it (Sapphire Rapids
    and later Xeons): the CPU class whose kernel choices differ (`uses_amx_gemm`,
    kernels.cpu_paged_attention)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return (probe is not None and probe() and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `pack` applies: a 2-D CPU weight in float32, or in bfloat16 where oneDNN has
    bf16 kernels for this CPU (AVX-512 or AMX), with torch built with oneDNN."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in _PACKED_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same values in oneDNN's blocked layout (a new mkldnn tensor;
    `weight` is left as it was). The layout is chosen for no particular batch size, which
    measured as fast as a size-specific one at every batch from 1 row to 512. Raises
    ValueError where `can_pack` is false."""
    if not can_pack(weight):
        raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight on "
                         f"{weight.device} for oneDNN")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def can_pack_skinny(weight: torch.Tensor) -> bool:
    """Whether `pack_skinny` applies: a 2-D CPU weight in float32 or bfloat16 (any CPU: the
    skinny GEMM widens bfloat16 itself), with the C++ extension built; for the tile GEMM
    (`uses_amx_gemm`) also an even number of input features."""
    if not (weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in _PACKED_DTYPES and cpu_extension.available()):
        return False
    return not uses_amx_gemm(weight.dtype) or weight.shape[1] % 2 == 0


def pack_skinny(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the second copy `linear` reads for batches of up to
    `skinny_max_rows(weight.dtype)` rows; `weight` is left as it was. Either the skinny GEMM's
    layout, [ceil(out / T), in, T] in weight's dtype, column tiles of T (32 or 64, the machine's
    vector width times 2 or 4) zero-padded past `out`; or, where `uses_amx_gemm`, the tile
    GEMM's, flat [out * in] bfloat16 in blocks of 128 output columns, each [in / 2][128][2]
    (the last block narrower). Raises ValueError where `can_pack_skinny` is false."""
    if not can_pack_skinny(weight):
        raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight on "
                         f"{weight.device} for the skinny GEMM")
    if uses_amx_gemm(weight.dtype):
        return cpu_extension.module().amx_gemm_pack(weight.detach())
    return cpu_extension.module().skinny_gemm_pack(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
           skinny: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias [out]) -> [..., out] in x's dtype, with the
    weight from `pack` (or dense, where `can_pack` is false) and optionally its `pack_skinny`
    copy, which batches of up to `skinny_max_rows(x.dtype)` rows run on; the same values as
    `F.linear` up to the order of float additions."""
    if (skinny is not None and x.dtype == skinny.dtype
            and x.numel() <= skinny_max_rows(x.dtype) * x.shape[-1]):
        ext = cpu_extension.module()
        gemm = ext.amx_gemm if is_amx_copy(skinny) else ext.skinny_gemm
        out = gemm(_rows(x), skinny, packed.shape[0], bias)
        return out.view(*x.shape[:-1], packed.shape[0])
    if packed.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.nn.functional.linear(x, packed, bias)


def linear_silu_and_mul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                        skinny: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu(gate) * up of `linear`'s output for a gate | up weight [2d, in]: x [..., in] ->
    [..., d] in one pass of the tile GEMM, where `linear` would run x on it (an AMX copy,
    `is_amx_copy`, and at most `AMX_MAX_ROWS` rows) and d is a whole number of its column
    blocks; the same values as the two ops. None elsewhere: the caller runs them."""
    out_features = packed.shape[0]
    if not _on_tile_gemm(x, skinny):
        return None
    ext = cpu_extension.module()
    if not ext.amx_gemm_fuses_silu(out_features):
        return None
    out = ext.amx_gemm_silu_and_mul(_rows(x), skinny, out_features, bias)
    return out.view(*x.shape[:-1], out_features // 2)


def linear_rope(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                skinny: torch.Tensor | None, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, rotated: int,
                head_dim: int) -> torch.Tensor | None:
    """`linear`'s output [..., out] with rotate-half RoPE applied to its first `rotated`
    features (heads of `head_dim`, at `positions` [rows], cos_sin_cache float32
    [max_position, head_dim] = cos | sin halves) in one pass of the tile GEMM, where `linear`
    would run x on it (as in `linear_silu_and_mul`) and the heads are whole column blocks;
    the same values as the two ops. None elsewhere: the caller runs them. Raises
    RuntimeError for a position outside the cache."""
    out_features = packed.shape[0]
    if not _on_tile_gemm(x, skinny):
        return None
    ext = cpu_extension.module()
    if not ext.amx_gemm_fuses_rope(out_features, rotated, head_dim):
        return None
    out = ext.amx_gemm_rope(_rows(x), skinny, out_features, bias, positions, cos_sin_cache,
                            rotated, head_dim)
    return out.view(*x.shape[:-1], out_features)


def _on_tile_gemm(x: torch.Tensor, skinny: torch.Tensor | None) -> bool:
    """Whether `linear` runs x on the tile GEMM: its copy is an AMX one (`is_amx_copy`) in
    x's dtype and x has at most `AMX_MAX_ROWS` rows."""
    return (skinny is not None and x.dtype == skinny.dtype and is_amx_copy(skinny)
            and x.numel() <= AMX_MAX_ROWS * x.shape[-1])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] as the C++ GEMMs take it: [rows, in] with unit column stride."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


_handles: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_skinny: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)
_handles_lock = threading.Lock()


def register(packed: torch.Tensor, skinny: torch.Tensor | None = None) -> int:
    """A handle naming `packed` (and its skinny copy) in `packed_linear` for as long as the
    tensors live (the registry holds them weakly, so a model's weights go when the model
    does)."""
    with _handles_lock:
        handle = next(_next_handle)
        _handles[handle] = packed
        if skinny is not None:
            _skinny[handle] = skinny
    return handle


@torch.library.custom_op("pdcluster::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` with the weights `register` returned `handle` for: x [..., in] ->
    [..., out_features]. Raises KeyError for a handle whose weight is gone."""
    return linear(x, _handles[handle], bias, _skinny.get(handle))


@packed_linear.register_fake
def _(x: torch.Tensor, handle: int, out_features: int,
      bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))
