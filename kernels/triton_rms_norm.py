"""Triton `rms_norm`: RMSNorm over the last dim, fused with the residual add (vLLM's
fused_add_rms_norm, but out of place).

One program per row holds the whole row in registers (hidden <= MAX_HIDDEN). Rounding follows
the reference step by step: the residual sum is rounded to x's dtype, the normalization runs in
float32 and is rounded to x's dtype before the weight multiply (transformers' LlamaRMSNorm).
Reference: `kernels.reference.rms_norm`.
"""

from __future__ import annotations

import torch

from pdcluster.kernels._triton_common import (Launch, as_rows, check_float, check_same_device,
                                              check_vector, next_pow2, output)
from pdcluster.kernels._triton_common import require, run_all, tl, triton

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_new_residual,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def plan_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
    target: str | None = None,
) -> tuple[list[Launch], torch.Tensor, torch.Tensor]:
    """Check inputs, allocate outputs (unless given) -> (launches, out, new_residual).

    x, residual: [..., hidden] of one float dtype, last dim contiguous, leading dims viewable as
    rows; weight: [hidden] of x's dtype, contiguous; hidden <= MAX_HIDDEN."""
    del target
    tensors = {"x": x, "weight": weight} | ({} if residual is None else {"residual": residual})
    device = check_same_device(**tensors)
    require(x.dim() >= 1 and x.shape[-1] > 0, f"x: expected [..., hidden], got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    require(hidden <= MAX_HIDDEN, f"x: hidden size {hidden} > {MAX_HIDDEN} is not supported")
    check_float("x", x)
    require(weight.dtype == x.dtype, f"weight: dtype {weight.dtype} != x dtype {x.dtype}")
    check_vector("weight", weight, hidden)
    x2 = as_rows("x", x)
    if residual is not None:
        require(
            residual.shape == x.shape and residual.dtype == x.dtype,
            f"residual: expected {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}",
        )
        residual2 = as_rows("residual", residual)
        new_residual = output(new_residual, tuple(x.shape), x.dtype, device, name="new_residual")
        new_residual2 = as_rows("new_residual", new_residual)
    else:
        require(new_residual is None, "new_residual: only with a residual (without one, new_residual is x)")
        residual2 = new_residual2 = x2  # unused by the kernel (HAS_RESIDUAL=False)
        new_residual = x
    out = output(out, tuple(x.shape), x.dtype, device)
    out2 = as_rows("out", out)
    block = next_pow2(hidden)
    launch = Launch(
        kernel=_rms_norm_kernel,
        grid=(x2.shape[0],),
        args={
            "x_ptr": x2,
            "residual_ptr": residual2,
            "weight_ptr": weight,
            "out_ptr": out2,
            "new_residual_ptr": new_residual2,
            "stride_x": x2.stride(0),
            "stride_residual": residual2.stride(0),
            "stride_out": out2.stride(0),
            "stride_new_residual": new_residual2.stride(0),
            "hidden": hidden,
            "eps": float(eps),
        },
        constexprs={"HAS_RESIDUAL": residual is not None, "BLOCK": block},
        device=device,
        num_warps=max(1, min(16, block // 512)),
        num_stages=1,
    )
    return [launch], out, new_residual


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out, new_residual); new_residual is x itself without a residual."""
    launches, out, new_residual = plan_rms_norm(x, weight, eps, residual)
    run_all(launches)
    return out, new_residual
