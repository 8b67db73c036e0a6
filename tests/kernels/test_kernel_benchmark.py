"""benchmarks/gpu_kernels.py keeps running: its smoke mode (tiny shapes; interpreted on CPU, where it
also checks every kernel against its reference) must exit cleanly and print the full table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


from tests.real_parts import import_real_part

import_real_part("triton", "Triton", "scripts/setup.sh installs it on Linux")


def test_kernel_benchmark_smoke_run():
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "benchmarks/gpu_kernels.py", "--smoke"], cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    for name in ("ceiling: device copy", "paged_decode_attention", "SDPA decode", "paged_prefill_attention",
                 "rms_norm", "silu_and_mul", "rotary_embedding", "store_kv_cache", "of copy bandwidth"):
        assert name in result.stdout, name


def test_prefill_sweep_smoke_run():
    """Every tile config of the smoke sweep gets a row, and each matches SDPA."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "benchmarks/gpu_kernels.py", "--sweep-prefill"], cwd=root,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 16 |")]
    assert len(rows) == 2, result.stdout
    assert not any("WRONG" in row or "failed" in row for row in rows), result.stdout
