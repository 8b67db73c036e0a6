"""The C++ paged attention kernels for CPU, decode (`cpu_paged_decode.cpp`) and prefill
(`cpu_paged_prefill.cpp`), built as one extension on first use.

`torch.utils.cpp_extension.load` compiles them with the machine's C++ compiler into torch's
extension cache (~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR), so later processes load
it without compiling. Where it cannot be built (no compiler, as in a slim image) `available()`
is False, with one warning, and callers keep the torch path (`kernels.torch_attention`).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False
#: compiled together (cpu_vec.h, which both kernels include, is tracked by ninja's deps)
_SOURCES = ("cpu_paged_attention.cpp", "cpu_paged_decode.cpp", "cpu_paged_prefill.cpp")


def _load() -> ModuleType | None:
    global _module, _failed
    if _module is not None or _failed:  # every decode attention call asks: no lock once known
        return _module
    with _lock:
        if _module is None and not _failed:
            if shutil.which(os.environ.get("CXX", "c++")) is None:
                _failed = True
                log.warning("no C++ compiler: CPU attention runs the slower torch path")
                return None
            from torch.utils import cpp_extension

            here = os.path.dirname(__file__)
            sources = [os.path.join(here, name) for name in _SOURCES]
            try:
                _module = cpp_extension.load(
                    "pdcluster_cpu_paged_attention", sources,
                    extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
                                  "-fassociative-math", "-fno-signed-zeros", "-fopenmp"],
                    # ATen's parallel_for is inlined here: without OpenMP it runs on one
                    # thread. The library resolves to the libgomp torch has loaded (same
                    # soname), so torch's thread count applies.
                    extra_ldflags=["-fopenmp"], verbose=False)
            except (RuntimeError, OSError, ImportError) as exc:
                _failed = True
                log.warning("building the C++ attention failed (%s): CPU attention runs "
                            "the slower torch path", exc)
        return _module


def available() -> bool:
    """Whether the kernel is built (building it now on the first call)."""
    return _load() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ kernels take these inputs (float32 CPU tensors, a head_dim it is
    specialized for: 16, 32, 48, 64, 80, 96, 112, 128, 160, 192 or 256) and could be built."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and k_cache.is_contiguous() and available()
            and _module.supports_head_dim(q.shape[-1]))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """See `torch_attention.paged_decode_attention`; float32 only (`supports`). Raises
    RuntimeError for inputs outside the contract (e.g. a seq_len beyond its block table)."""
    return _load().paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """See `torch_attention.paged_prefill_attention`; float32 only (`supports`). Raises
    RuntimeError for inputs outside the contract (a seq_len beyond its block table or shorter
    than its new tokens)."""
    return _load().paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                           seq_lens, scale)
