"""The workers' allocation (deploy/preload.py): tcmalloc found where the dynamic linker's cache
has it, an inherited LD_PRELOAD kept; torch's large tensors on huge pages where the kernel
grants them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.deploy import preload


def _in_ld_cache(soname: str) -> bool:
    return soname in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout


def test_nothing_is_preloaded_when_asked_for_none():
    assert preload.worker_preload("none") == {}
    with pytest.raises(ValueError):
        preload.worker_preload("always")


@pytest.mark.skipif(not _in_ld_cache("libtcmalloc_minimal.so.4"), reason="no tcmalloc")
def test_tcmalloc_is_found_in_the_linker_cache(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    [path] = preload.worker_preload("auto")["LD_PRELOAD"].split(":")
    assert Path(path).name == "libtcmalloc_minimal.so.4" and Path(path).exists()


@pytest.mark.skipif(not _in_ld_cache("libtcmalloc_minimal.so.4"), reason="no tcmalloc")
def test_an_inherited_ld_preload_is_kept_first(monkeypatch, tmp_path):
    mine = tmp_path / "libmine.so"
    monkeypatch.setenv("LD_PRELOAD", str(mine))
    paths = preload.worker_preload("auto")["LD_PRELOAD"].split(":")
    assert paths[0] == str(mine) and len(paths) == 2


def test_huge_pages_follow_the_kernel_s_mode(monkeypatch, tmp_path):
    assert preload.worker_huge_pages("none") == {}
    with pytest.raises(ValueError):
        preload.worker_huge_pages("always")
    mode = tmp_path / "enabled"
    monkeypatch.setattr(preload, "THP_ENABLED", str(mode))
    assert preload.worker_huge_pages("auto") == {}  # no such file: no THP in this kernel
    for line, granted in (("always [madvise] never", True), ("[always] madvise never", True),
                          ("always madvise [never]", False)):
        mode.write_text(line + "\n")
        assert preload.transparent_huge_pages() is granted
        assert preload.worker_huge_pages("auto") == ({"THP_MEM_ALLOC_ENABLE": "1"} if granted
                                                      else {})


_TOUCH_64_MIB = """
import torch
x = torch.ones(16 << 20)  # 64 MiB, written through
print(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0])
"""


@pytest.mark.skipif(not preload.transparent_huge_pages(), reason="no transparent huge pages")
def test_a_worker_s_large_tensors_land_on_huge_pages():
    """A fresh process with the workers' environment gets huge pages under a 64 MiB tensor;
    where the kernel only grants them on request ("madvise"), one without it gets none."""
    def huge_kib(env: dict[str, str]) -> int:
        base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        out = subprocess.run([sys.executable, "-c", _TOUCH_64_MIB], env={**base, **env},
                             capture_output=True, text=True, check=True, timeout=120).stdout
        return int(out.strip())

    assert huge_kib(preload.worker_huge_pages("auto")) >= 32 << 10
    if "[madvise]" in open(preload.THP_ENABLED).read():
        assert huge_kib({}) == 0
