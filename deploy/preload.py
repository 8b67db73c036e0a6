"""How the worker processes allocate memory: tcmalloc preloaded as their allocator, as vLLM's
CPU guide recommends for its own workers, and torch's large CPU tensors (weights, KV cache) on
transparent huge pages.

Why: a decode step allocates and frees the same few activation sizes in every layer, which
tcmalloc's per-thread caches serve without the locks and page faults glibc's malloc takes on
large blocks. It is found, never downloaded: from the OS packages (`libtcmalloc-minimal4`,
which `scripts/setup.sh` and the CPU image install). Preloading acts only when a process
starts, so it goes on the worker actors' runtime environment; a cluster started with
`ray start` takes it from that command's environment.

Intel's OpenMP runtime (libiomp5, which vLLM also preloads) is not: measured on our engine it
gained nothing over tcmalloc with pinned threads, and a team of its spin-waiting threads that
is not pinned lost a third of the throughput (benchmarks/RESULTS.md).

Huge pages: a decode step streams every weight once, and on 4 KiB pages each 4 KiB costs a TLB
miss, whose page walk is long under a hypervisor's nested paging. torch asks the kernel for
transparent huge pages on its CPU allocations of 2 MiB or more when THP_MEM_ALLOC_ENABLE=1 is
in its environment (c10's alloc_cpu, read once per process), which a kernel whose THP mode is
"madvise" (a common default) grants. Both a plain read of memory and a decode step measured
faster on them (docs/notes/cpu-runtime-findings.md, "Weights and KV cache on huge pages").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: sonames searched in the dynamic linker's cache, in order of preference
TCMALLOC_SONAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
#: the kernel's transparent huge page mode: "[always] madvise never" with the current one
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def find_tcmalloc() -> str | None:
    """Path of tcmalloc in the dynamic linker's cache (`ldconfig -p`), or None."""
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                               timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for soname in TCMALLOC_SONAMES:
        for line in cache.splitlines():
            if line.strip().startswith(soname + " ") and "=>" in line:
                path = line.rsplit("=>", 1)[1].strip()
                if os.path.exists(path):
                    return path
    return None


def worker_preload(mode: str) -> dict[str, str]:
    """Environment variables that make a new worker process preload tcmalloc.

    mode: "auto" (tcmalloc where installed) or "none" (nothing). Returns {"LD_PRELOAD":
    paths} keeping any LD_PRELOAD this process was given, or {} when there is nothing to add.
    Raises ValueError for another mode.
    """
    if mode not in ("auto", "none"):
        raise ValueError(f"worker preload must be 'auto' or 'none', got {mode!r}")
    found = find_tcmalloc() if mode == "auto" and sys.platform.startswith("linux") else None
    if found is None:
        return {}
    paths = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    if found not in paths:
        paths.append(found)
    return {"LD_PRELOAD": ":".join(paths)}


def transparent_huge_pages() -> bool:
    """Whether this kernel grants transparent huge pages to a process that asks (madvise):
    its mode (THP_ENABLED) is "always" or "madvise", not "never" or absent."""
    try:
        modes = Path(THP_ENABLED).read_text()
    except OSError:
        return False
    return "[never]" not in modes and "[" in modes


def worker_huge_pages(mode: str) -> dict[str, str]:
    """Environment variables that put a new worker process's large torch CPU tensors on
    transparent huge pages.

    mode: "auto" (where the kernel grants them, `transparent_huge_pages`) or "none"
    (nothing). Returns {"THP_MEM_ALLOC_ENABLE": "1"} or {}. Raises ValueError for another
    mode.
    """
    if mode not in ("auto", "none"):
        raise ValueError(f"worker huge pages must be 'auto' or 'none', got {mode!r}")
    if mode == "auto" and sys.platform.startswith("linux") and transparent_huge_pages():
        return {"THP_MEM_ALLOC_ENABLE": "1"}
    return {}
