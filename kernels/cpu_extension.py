"""The C++ kernels for CPU, built as one extension on first use: paged attention for decode
(`cpu_paged_decode.cpp`) and prefill (`cpu_paged_prefill.cpp`; in bfloat16 on AMX tiles,
`cpu_amx_prefill.cpp`), the fused elementwise
ops of a decoder layer (`cpu_fused_ops.cpp`), the linear GEMM for decode batches
(`cpu_skinny_gemm.cpp`) and for bfloat16 prefill batches on AMX tiles (`cpu_amx_gemm.cpp`), an all-decode step's decoder layers in one call
(`cpu_decode_stack.cpp`), and the pinning of torch's OpenMP threads to cores
(`cpu_threads.cpp`); `cpu_extension.cpp` binds them.

`torch.utils.cpp_extension.load` compiles them with the machine's C++ compiler into torch's
extension cache (~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR), so later processes load
it without compiling. The build is named after this directory: ninja rebuilds a build whose
source paths changed, so two checkouts or installs sharing one name would rebuild each
other's. Where it cannot be built (no compiler, as in a slim image) `module()` is None, with
one warning, and callers keep the torch paths (`kernels.torch_attention`,
`kernels.reference`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from types import ModuleType

log = logging.getLogger(__name__)

_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False
#: compiled together (cpu_vec.h, which the kernels include, is tracked by ninja's deps)
_SOURCES = ("cpu_extension.cpp", "cpu_paged_decode.cpp", "cpu_paged_prefill.cpp",
            "cpu_amx_prefill.cpp", "cpu_fused_ops.cpp", "cpu_skinny_gemm.cpp", "cpu_amx_gemm.cpp",
            "cpu_threads.cpp", "cpu_decode_stack.cpp")
#: a build lock older than this was left by a build that died (torch's FileBaton waits for it
#: forever); a live build of these sources takes 1-2 minutes on 2 cores
STALE_LOCK_S = 600.0


def module() -> ModuleType | None:
    """The built extension (building it now on the first call), or None where it cannot be
    built."""
    global _module, _failed
    if _module is not None or _failed:  # every kernel call asks: no lock once known
        return _module
    with _lock:
        if _module is None and not _failed:
            if not has_cxx_compiler():
                _failed = True
                log.warning("no C++ compiler: CPU attention and layer ops run the slower torch "
                            "paths")
                return None
            from torch.utils import cpp_extension

            here = os.path.dirname(__file__)
            sources = [os.path.join(here, name) for name in _SOURCES]
            name = f"pdcluster_cpu_kernels_{hashlib.sha1(here.encode()).hexdigest()[:8]}"
            compiling = not _build_cached(cpp_extension, name, here)
            if compiling:
                log.warning("compiling pdcluster's C++ CPU kernels, once: about 1-2 minutes on "
                            "2 cores; later starts reuse the build")
            try:  # torch's private lookup: if it goes, torch's own wait for the lock stands
                clear_stale_lock(cpp_extension._get_build_directory(name, False))
            except Exception:  # noqa: BLE001
                pass
            started = time.monotonic()
            try:
                _module = cpp_extension.load(
                    name,
                    sources,
                    extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
                                  "-fassociative-math", "-fno-signed-zeros", "-fopenmp"],
                    # ATen's parallel_for is inlined here: without OpenMP it runs on one
                    # thread. The library resolves to the libgomp torch has loaded (same
                    # soname), so torch's thread count applies.
                    extra_ldflags=["-fopenmp"], verbose=False)
                if compiling:
                    log.warning("compiled the C++ CPU kernels in %.0f s",
                                time.monotonic() - started)
            except (RuntimeError, OSError, ImportError) as exc:
                _failed = True
                log.warning("building the C++ CPU kernels failed (%s): CPU attention and layer "
                            "ops run the slower torch paths", exc)
        return _module


def clear_stale_lock(build_directory: str, stale_s: float = STALE_LOCK_S) -> bool:
    """Remove the build lock of ``build_directory`` when it is older than ``stale_s`` seconds:
    a build killed midway (a Ctrl-C during the first start) leaves it, and every later build
    would wait on it forever. True when one was removed."""
    lock = os.path.join(build_directory, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except FileNotFoundError:
        return False
    if age < stale_s:
        return False  # another process is building: wait for it
    log.warning("removing the C++ kernels' build lock left %.0f s ago by a build that did not "
                "finish", age)
    try:
        os.remove(lock)
    except FileNotFoundError:
        pass
    return True


def _build_cached(cpp_extension: ModuleType, name: str, here: str) -> bool:
    """Whether torch's extension cache holds a build of `name` newer than every C++ source
    and header in `here`, so that `cpp_extension.load` will not compile."""
    try:  # torch's own lookup of the build directory (private: if it goes, assume cached)
        built = os.path.join(cpp_extension._get_build_directory(name, False), f"{name}.so")
        newest = max(os.path.getmtime(os.path.join(here, f)) for f in os.listdir(here)
                     if f.endswith((".cpp", ".h")))
        return os.path.getmtime(built) >= newest
    except FileNotFoundError:
        return False
    except Exception:  # only the log message depends on it
        return True


def has_cxx_compiler() -> bool:
    """Whether the C++ compiler torch builds with (CXX, default c++) is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def available() -> bool:
    """Whether the extension is built (building it now on the first call)."""
    return module() is not None
