"""benchmarks/kernels.py keeps running: its smoke mode (tiny shapes; interpreted on CPU, where it
also checks every kernel against its reference) must exit cleanly and print the full table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernel_benchmark_smoke_run():
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "benchmarks/kernels.py", "--smoke"], cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    for name in ("ceiling: device copy", "paged_decode_attention", "SDPA decode", "paged_prefill_attention",
                 "rms_norm", "silu_and_mul", "rotary_embedding", "store_kv_cache", "of copy bandwidth"):
        assert name in result.stdout, name
