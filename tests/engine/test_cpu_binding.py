"""CPU binding (engine.cpu_binding): cpu lists, node-local core claims that die with their
holder, and the pinning of torch's OpenMP team one thread per core, read back from the
kernel (/proc/<pid>/task/<tid>/status)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdcluster.kernels import cpu_extension
from pdcluster.engine import cpu_binding
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.cpu_binding import CoreClaims, format_cpu_list, parse_cpu_list
from tests.real_parts import real_part

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_lists_parse_and_format_as_linux_writes_them():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]
    assert parse_cpu_list("3,1-2,2") == [1, 2, 3]
    assert format_cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert format_cpu_list([4]) == "4"
    for bad in ("", "a", "1-", "3-1", "0,,1", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    assert EngineConfig(cpu_bind="0-3").cpu_bind == "0-3"
    with pytest.raises(ValueError):
        EngineConfig(cpu_bind="all")


def test_split_sets_cores_aside_only_when_they_outnumber_the_threads():
    assert cpu_binding.split_node_cores(4, [0, 1, 2, 3]) is None
    assert cpu_binding.split_node_cores(6, [0, 1, 2, 3]) is None
    workers, rest = cpu_binding.split_node_cores(2, [0, 1, 2, 3])
    assert len(workers) == 2 and sorted(workers + rest) == [0, 1, 2, 3]


def test_claims_are_exclusive_and_given_back(tmp_path):
    first, second = CoreClaims(tmp_path), CoreClaims(tmp_path)
    assert first.claim(2, [0, 1, 2]) is not None
    taken = set(first.cpus)
    got = second.claim(1, [0, 1, 2])
    assert got is not None and not taken & set(got)
    assert second.claim(2, [0, 1, 2]) is None and second.cpus == []  # all or nothing
    first.release()
    assert second.claim(3, [0, 1, 2]) == [0, 1, 2]


def test_a_dead_holders_cores_are_free_again(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from pdcluster.engine.cpu_binding import CoreClaims
            claims = CoreClaims(Path({str(tmp_path)!r}))
            print(claims.claim(2, [0, 1]), flush=True)
            time.sleep(600)
        """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "[0, 1]"
        assert CoreClaims(tmp_path).claim(1, [0, 1]) is None
        holder.kill()
        holder.wait(timeout=10)
        assert CoreClaims(tmp_path).claim(2, [0, 1]) == [0, 1]
    finally:
        holder.kill()


def test_too_few_free_cores_leave_the_threads_unpinned(tmp_path, caplog):
    pool = sorted(os.sched_getaffinity(0))[:1]
    squatter = CoreClaims(tmp_path)
    assert squatter.claim(1, pool) == pool
    with caplog.at_level(logging.WARNING, logger="pdcluster.engine.cpu_binding"):
        assert cpu_binding.bind_threads(format_cpu_list(pool), 1, CoreClaims(tmp_path)) is None
    assert "unpinned" in caplog.text
    assert cpu_binding.bind_threads("none", 1, CoreClaims(tmp_path)) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@real_part("the C++ CPU extension", cpu_extension.available(), "no C++ compiler")
def test_the_openmp_team_runs_one_thread_per_claimed_core(tmp_path):
    """In a fresh process (as a worker is): after bind_threads, torch's ops run on a team whose
    every thread the kernel reports as allowed on exactly one core, a different core each,
    together the claimed cores."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    script = textwrap.dedent(f"""
        import json, os, torch
        from pathlib import Path
        from pdcluster.engine.cpu_binding import CoreClaims, bind_threads
        torch.set_num_threads(2)
        got = bind_threads({format_cpu_list(cores)!r}, 2, CoreClaims(Path({str(tmp_path)!r})))
        x = torch.randn(1024, 1024)
        for _ in range(20):
            x = torch.tanh(x @ x / 1024)
        masks = {{}}
        for tid in os.listdir("/proc/self/task"):
            status = Path(f"/proc/self/task/{{tid}}/status").read_text()
            line = next(l for l in status.splitlines() if l.startswith("Cpus_allowed_list"))
            masks[tid] = line.split(":")[1].strip()
        print(json.dumps({{"got": got, "main": masks[str(os.getpid())],
                          "masks": sorted(masks.values())}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["got"] == cores
    single = [m for m in result["masks"] if m in {str(c) for c in cores}]
    assert sorted(single) == sorted(str(c) for c in cores)  # one thread on each, no more
    assert result["main"] in {str(c) for c in cores}  # the calling thread is in the team


def test_a_core_this_process_may_not_use_is_refused_not_claimed(tmp_path, caplog):
    """A cpu list naming a core outside the machine (or the process's cgroup) pins nothing,
    warns, and gives the claim back."""
    missing = min(max(os.sched_getaffinity(0)) + 64, 1023)  # within cpu_set_t, not present
    claims = CoreClaims(tmp_path)
    with caplog.at_level(logging.WARNING, logger="pdcluster.engine.cpu_binding"):
        assert cpu_binding.bind_threads(str(missing), 1, claims) is None
    assert "unpinned" in caplog.text and claims.cpus == []


def test_declared_worker_cores_are_read_back_whole(tmp_path):
    claims = CoreClaims(tmp_path / "claims")
    assert claims.worker_cores() is None
    claims.set_worker_cores([3, 0, 1])
    assert CoreClaims(tmp_path / "claims").worker_cores() == [0, 1, 3]
    (tmp_path / "claims" / "workers").write_text("not a list\n")
    assert claims.worker_cores() is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_auto_claims_the_declared_worker_cores_beyond_an_inherited_confinement(tmp_path):
    """A worker started by a Ray confined to one core (it inherits that mask) claims, with
    "auto", the core its node declared for the engines, and runs there."""
    ray_core, worker_core = sorted(os.sched_getaffinity(0))[:2]
    CoreClaims(tmp_path).set_worker_cores([worker_core])
    script = textwrap.dedent(f"""
        import json, os, torch
        from pathlib import Path
        from pdcluster.engine.cpu_binding import CoreClaims, bind_threads
        torch.set_num_threads(1)
        inherited = sorted(os.sched_getaffinity(0))
        got = bind_threads("auto", 1, CoreClaims(Path({str(tmp_path)!r})))
        print(json.dumps({{"inherited": inherited, "got": got,
                          "now": sorted(os.sched_getaffinity(0))}}))
    """)
    out = subprocess.run(["taskset", "-c", str(ray_core), sys.executable, "-c", script],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"inherited": [ray_core], "got": [worker_core], "now": [worker_core]}
