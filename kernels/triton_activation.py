"""Triton `silu_and_mul`: SwiGLU activation, x [..., 2d] = gate | up -> silu(gate) * up [..., d].

Grid (rows, column blocks). silu is computed in float32 and rounded to x's dtype before the
multiply, as torch does for `silu(gate) * up`. Reference: `kernels.reference.silu_and_mul`.
"""

from __future__ import annotations

import torch

from pdcluster.kernels._triton_common import (Launch, as_rows, check_float, check_same_device,
                                              next_pow2, output, require)
from pdcluster.kernels._triton_common import run_all, tl, triton

MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def plan_silu_and_mul(
    x: torch.Tensor, out: torch.Tensor | None = None, target: str | None = None
) -> tuple[list[Launch], torch.Tensor]:
    """Check inputs, allocate `out` unless given -> (launches, out).

    x: [..., 2d] float, last dim contiguous, leading dims viewable as rows."""
    del target
    device = check_same_device(x=x)
    check_float("x", x)
    require(x.dim() >= 1 and x.shape[-1] % 2 == 0, f"x: expected [..., 2*d], got shape {tuple(x.shape)}")
    x2 = as_rows("x", x)
    d = x.shape[-1] // 2
    shape = (*x.shape[:-1], d)
    out = output(out, shape, x.dtype, device)
    out2 = out.view(-1, d)
    block = min(next_pow2(d), MAX_BLOCK)
    launch = Launch(
        kernel=_silu_and_mul_kernel,
        grid=(x2.shape[0], triton.cdiv(d, block)),
        args={"x_ptr": x2, "out_ptr": out2, "stride_x": x2.stride(0), "stride_out": out2.stride(0), "d": d},
        constexprs={"BLOCK": block},
        device=device,
        num_warps=max(1, min(8, block // 256)),
        num_stages=1,
    )
    return [launch], out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    launches, out = plan_silu_and_mul(x)
    run_all(launches)
    return out
