"""The linear layer's GEMM on CPU: oneDNN with weights packed once, at load.

`F.linear` on CPU calls BLAS with the weight in its plain [out, in] layout, and BLAS then
re-blocks the weight on every call; at decode batch sizes that traffic, not arithmetic, sets
the step time, and on some CPUs the BLAS kernel chosen is far from the machine's peak even for
prefill-sized batches. oneDNN can reorder a weight into its own blocked layout once, and its
matmul then streams that layout at close to the memory bandwidth for a few rows and near the
FMA peak for many (benchmarks/RESULTS.md, "oneDNN-packed linear weights"). vLLM's CPU
backend packs its linear weights the same way; Inductor's freezing pass does it for bf16.

A packed weight is an opaque mkldnn tensor (`is_mkldnn`), [out, in] in shape only: it is read
by `linear` here and nothing else, so the embedding table a tied lm_head shares is packed as a
copy.

torch.compile cannot trace an opaque tensor (it has no storage to fake), so a compiled graph
names a packed weight by an integer handle (`register`) and calls the custom op
`pdcluster::packed_linear`, which looks the weight up when the graph runs.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

_PACKED_DTYPES = (torch.float32, torch.bfloat16)


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


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias [out]) -> [..., out] in x's dtype, with the
    weight from `pack`; the same values as `F.linear` up to the order of float additions."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_handles: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)
_handles_lock = threading.Lock()


def register(packed: torch.Tensor) -> int:
    """A handle naming `packed` in `packed_linear` for as long as the tensor lives (the registry
    holds it weakly, so a model's weights go when the model does)."""
    with _handles_lock:
        handle = next(_next_handle)
        _handles[handle] = packed
    return handle


@torch.library.custom_op("pdcluster::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` with the packed weight `register` returned `handle` for: x [..., in] ->
    [..., out_features]. Raises KeyError for a handle whose weight is gone."""
    return linear(x, _handles[handle], bias)


@packed_linear.register_fake
def _(x: torch.Tensor, handle: int, out_features: int,
      bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))
