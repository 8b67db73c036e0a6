"""The linear layer's GEMM on CPU for decode-sized batches.

A decode step multiplies a few rows of activations (one per running sequence) by every weight
of the model, so it is bound by reading the weights, not by arithmetic. `F.linear` hands BLAS
the activations as the left operand, x @ W^T, and for a handful of rows the CPU BLAS then
streams W far below the memory bandwidth. Asking for the transposed product, W @ x^T, makes
W the left operand, which BLAS streams at close to the bandwidth (benchmarks/RESULTS.md, "CPU
GEMM at decode batch sizes"). One row takes BLAS's matrix-vector path, which is as slow as
F.linear, so it is padded to two. From about a dozen rows the GEMM turns compute-bound and the
two forms are alike, so larger batches (prefill) keep F.linear.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

#: The most rows that take the transposed product.
MAX_SKINNY_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ weight [out, in]^T (+ bias [out]) -> contiguous [n, out], x's dtype; the
    same values as `F.linear` up to the order of float additions."""
    rows = x.shape[0]
    if x.dim() != 2 or rows > MAX_SKINNY_ROWS or rows == 0:
        return F.linear(x, weight, bias)
    if rows == 1:
        out = (weight @ torch.cat((x, x)).t())[:, :1].t().contiguous()
    else:
        out = (weight @ x.t()).t().contiguous()
    return out if bias is None else out + bias
