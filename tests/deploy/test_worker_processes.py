"""The engines of the local Ray cluster run at the gateway's priority, not at Ray's default
worker niceness of 15 (deploy/local_ray.py), on cores of their own (engine.cpu_binding) and
with the preloaded libraries (deploy/preload.py)."""

from __future__ import annotations

import os

import psutil
import pytest

from pdcluster.deploy import preload
from pdcluster.engine.cpu_binding import parse_cpu_list

from tests.security.conftest import module_serve  # noqa: F401  (the fixture)

# the pinning test reads which cores the engines claimed: another cluster's would take them
pytestmark = [pytest.mark.slow, pytest.mark.exclusive]


@pytest.fixture(scope="module")
def served(module_serve):  # noqa: F811
    """One `pdcluster serve` (default flags) for the module: its tests only look at it."""
    return module_serve()


def test_engine_workers_run_at_the_gateways_niceness(served):
    gateway = psutil.Process(served.proc.pid)
    engines = [p for p in served.tree if p.name().startswith(("ray::PrefillWorker",
                                                               "ray::DecodeWorker"))]
    assert engines, [p.name() for p in served.tree]  # not vacuous
    assert {p.nice() for p in engines} == {gateway.nice()}


def _allowed_cpus(pid: int, tid: int | None = None) -> set[int]:
    path = f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status"
    line = next(line for line in open(path).read().splitlines()
                if line.startswith("Cpus_allowed_list"))
    return set(parse_cpu_list(line.split(":")[1].strip()))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_each_engine_pins_its_threads_to_cores_no_other_engine_has(served):
    """One prefill and one decode engine, one torch thread each: each runs its team on one
    core the kernel allows it alone, and the two cores differ. Where the machine has cores to
    spare, Ray's raylet runs off the engines' cores."""
    engines = [p for p in served.tree if p.name().startswith(("ray::PrefillWorker",
                                                               "ray::DecodeWorker"))]
    assert len(engines) == 2, [p.name() for p in served.tree]
    pinned = []
    for engine in engines:
        masks = [_allowed_cpus(engine.pid, t.id) for t in engine.threads()]
        single = [m for m in masks if len(m) == 1]
        assert single, masks
        cores = set().union(*single)  # the team, and any thread it started since
        assert len(cores) == 1, masks
        pinned.append(cores)
    assert pinned[0] != pinned[1]
    if len(os.sched_getaffinity(0)) > 2:
        raylet = [p for p in served.tree if p.name() == "raylet"]
        assert raylet and not _allowed_cpus(raylet[0].pid) & (pinned[0] | pinned[1])


@pytest.mark.skipif(preload.find_tcmalloc() is None and not preload.transparent_huge_pages(),
                    reason="no tcmalloc installed and no transparent huge pages")
def test_engines_run_on_tcmalloc_and_huge_pages_and_the_gateway_as_started(served):
    """The preload reaches the engine processes Ray starts (their memory maps name the
    library), and so does torch's switch to huge pages (their environment has it); the
    gateway itself is left as it was started."""
    engines = [p for p in served.tree if p.name().startswith(("ray::PrefillWorker",
                                                               "ray::DecodeWorker"))]
    assert engines
    tcmalloc, huge_pages = preload.find_tcmalloc() is not None, preload.transparent_huge_pages()
    for engine in engines:
        assert ("libtcmalloc" in open(f"/proc/{engine.pid}/maps").read()) == tcmalloc
        assert engine.environ().get("THP_MEM_ALLOC_ENABLE") == ("1" if huge_pages else None)
    assert "libtcmalloc" not in open(f"/proc/{served.proc.pid}/maps").read()
    assert "THP_MEM_ALLOC_ENABLE" not in psutil.Process(served.proc.pid).environ()
