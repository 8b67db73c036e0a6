"""What the worker processes preload: tcmalloc as their allocator, as vLLM's CPU guide
recommends for its own workers.

Why: a decode step allocates and frees the same few activation sizes in every layer, which
tcmalloc's per-thread caches serve without the locks and page faults glibc's malloc takes on
large blocks. It is found, never downloaded: from the OS packages (`libtcmalloc-minimal4`,
which `scripts/setup.sh` and the CPU image install). Preloading acts only when a process
starts, so it goes on the worker actors' runtime environment; a cluster started with
`ray start` takes it from that command's environment.

Intel's OpenMP runtime (libiomp5, which vLLM also preloads) is not: measured on our engine it
gained nothing over tcmalloc with pinned threads, and a team of its spin-waiting threads that
is not pinned lost a third of the throughput (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

#: sonames searched in the dynamic linker's cache, in order of preference
TCMALLOC_SONAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


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
