"""The workers' preload (deploy/preload.py): tcmalloc found where the dynamic linker's cache
has it, an inherited LD_PRELOAD kept."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from deploy import preload


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
