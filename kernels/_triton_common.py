"""Shared pieces of the Triton launchers: input checks, tile configs, and the `Launch` record.

Every launcher is split in two: `plan_*` checks its inputs, allocates outputs and returns the
`Launch`es it needs (kernel, grid, runtime arguments, constexprs, warps, stages); `Launch.run`
starts one. `tests/kernels/aot.py` compiles the very same `Launch` records for a GPU target on a
machine without one, so what CI compiles is what the engine launches.

Importing this module imports triton. Triton picks its interpreter (`TRITON_INTERPRET=1`) when
a kernel is decorated, i.e. when the `kernels.triton_*` modules are first imported; a CPU tensor
can only go to a Triton kernel then.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl  # noqa: F401 — the launchers import tl and triton from here
from triton.runtime.interpreter import InterpretedFunction

LOG2E = 1.4426950408889634

# torch dtypes the kernels accept (activations and KV cache).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_CACHE_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"


class KernelInputError(ValueError):
    """A launcher got tensors it does not support (shape, stride, dtype or device)."""


def require(condition: bool, message: str) -> None:
    """Raise KernelInputError(message) unless `condition` (never stripped like `assert`)."""
    if not condition:
        raise KernelInputError(message)


def check_float(name: str, tensor: torch.Tensor) -> None:
    require(
        tensor.dtype in FLOAT_DTYPES,
        f"{name}: dtype {tensor.dtype} is not supported (float32, float16 or bfloat16)",
    )


def check_int(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.int32,)) -> None:
    names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    require(tensor.dtype in dtypes, f"{name}: dtype {tensor.dtype} is not supported ({names})")


def check_rank(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    require(tensor.dim() == rank, f"{name}: expected {rank}-D {layout}, got shape {tuple(tensor.shape)}")


def check_last_contiguous(name: str, tensor: torch.Tensor) -> None:
    require(
        tensor.shape[-1] <= 1 or tensor.stride(-1) == 1,
        f"{name}: the last dimension must be contiguous (stride 1), got strides {tuple(tensor.stride())}",
    )


def as_rows(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """[..., width], last dimension contiguous, as a 2-D view [rows, width] (no copy)."""
    check_last_contiguous(name, tensor)
    try:
        return tensor.view(-1, tensor.shape[-1])
    except RuntimeError as error:
        raise KernelInputError(f"{name}: strides {tensor.stride()} cannot be viewed as [rows, width]") from error


def check_float_inputs(**tensors: torch.Tensor) -> None:
    """Each tensor (by name): a supported float dtype, last dimension contiguous."""
    for name, tensor in tensors.items():
        check_float(name, tensor)
        check_last_contiguous(name, tensor)


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache in the paged layout (`KV_CACHE_LAYOUT`); v_cache of the same shape and strides."""
    check_rank("k_cache", k_cache, 4, KV_CACHE_LAYOUT)
    require(
        v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(),
        f"v_cache: shape/strides {tuple(v_cache.shape)}/{v_cache.stride()} != k_cache "
        f"{tuple(k_cache.shape)}/{k_cache.stride()}",
    )


def cache_strides(k_cache: torch.Tensor) -> dict[str, int]:
    """The kernels' `stride_c_*` arguments of a paged cache (v_cache has the same strides)."""
    return {
        "stride_c_block": k_cache.stride(0),
        "stride_c_slot": k_cache.stride(1),
        "stride_c_head": k_cache.stride(2),
    }


def check_vector(name: str, tensor: torch.Tensor, length: int) -> None:
    """A contiguous 1-D tensor of `length` elements."""
    require(
        tuple(tensor.shape) == (length,) and (length <= 1 or tensor.stride(0) == 1),
        f"{name}: expected contiguous [{length}], got shape {tuple(tensor.shape)} strides {tensor.stride()}",
    )


def check_index_vector(name: str, tensor: torch.Tensor, length: int) -> None:
    """A per-token index (cache slots, positions): int32 or int64, contiguous [length]."""
    check_int(name, tensor, (torch.int32, torch.int64))
    check_vector(name, tensor, length)


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    require(
        all(d == first for d in devices.values()),
        f"all tensors must be on one device, got { {n: str(d) for n, d in devices.items()} }",
    )
    require(first.type in ("cuda", "cpu"), f"device {first} is not supported (cuda, or cpu under TRITON_INTERPRET=1)")
    return first


def output(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, name: str = "out"
) -> torch.Tensor:
    """`out` checked (shape, dtype, device, last dimension contiguous), or a new empty tensor when None."""
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    require(
        tuple(out.shape) == tuple(shape) and out.dtype == dtype and out.device == device,
        f"{name}: expected shape {tuple(shape)} {dtype} on {device}, "
        f"got {tuple(out.shape)} {out.dtype} on {out.device}",
    )
    check_last_contiguous(name, out)
    return out


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: IEEE for float32 (no TF32 rounding), the default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def for_gpu(device: torch.device, target: str | None) -> bool:
    """Tile configs: `target` "gpu" / "interpreter" overrides; else GPU configs for CUDA tensors.

    The interpreter runs each program as Python, so it gets small tiles (more tiles per case,
    cheaper per tile); the AOT compile test asks for the GPU configs with CPU tensors."""
    if target is not None:
        require(target in ("gpu", "interpreter"), f"target must be 'gpu' or 'interpreter', got {target!r}")
        return target == "gpu"
    return device.type == "cuda"


def is_interpreted(kernel: Any) -> bool:
    return isinstance(kernel, InterpretedFunction)


@dataclass
class Launch:
    """One kernel launch: `kernel[grid](**args, **constexprs, num_warps=..., num_stages=...)`.

    `args` holds the runtime arguments in the kernel's parameter order (tensors, ints, floats);
    `device` is where the tensors live (a CPU launch needs the interpreter)."""

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    constexprs: dict[str, Any]
    device: torch.device
    num_warps: int = 4
    num_stages: int = 2
    options: dict[str, Any] = field(default_factory=lambda: {"enable_fp_fusion": True})

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__

    def run(self) -> None:
        if any(g == 0 for g in self.grid):
            return
        if self.device.type != "cuda" and not is_interpreted(self.kernel):
            raise RuntimeError(
                f"{self.name}: Triton runs CPU tensors only in its interpreter; set TRITON_INTERPRET=1 in the "
                "environment before triton and kernels.triton_* are imported (or use the torch backend)"
            )
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self.kernel[self.grid](
                **self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages, **self.options
            )


def run_all(launches: list[Launch]) -> None:
    for launch in launches:
        launch.run()
