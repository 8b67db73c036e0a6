"""deploy/node_cores.py: a worker node's cores split between Ray's processes and the engines."""

from __future__ import annotations

import os

import pytest

from pdcluster.deploy import node_cores
from pdcluster.engine.cpu_binding import CoreClaims, physical_first


def test_reserve_gives_ray_the_cores_the_engines_physical_first_choice_leaves():
    cores = [0, 1, 2, 3]
    workers, ray = node_cores.split(cores, reserve=1)
    assert len(ray) == 1 and sorted(workers + ray) == cores
    assert workers == sorted(physical_first(cores)[:3])


def test_explicit_ray_cpus_and_bad_splits():
    assert node_cores.split([4, 5, 6], ray_cpus=[6]) == ([4, 5], [6])
    with pytest.raises(ValueError, match="not this node's"):
        node_cores.split([4, 5, 6], ray_cpus=[7])
    with pytest.raises(ValueError, match="engines"):
        node_cores.split([4, 5], ray_cpus=[4, 5])
    for reserve in (0, 2, 3):
        with pytest.raises(ValueError, match="reserve"):
            node_cores.split([4, 5], reserve=reserve)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_main_prints_ray_s_cores_and_declares_the_rest(tmp_path, capsys):
    cores = sorted(os.sched_getaffinity(0))
    assert node_cores.main(["--reserve", "1", "--claims-dir", str(tmp_path)]) == 0
    ray = int(capsys.readouterr().out)  # one core: a one-number cpu list
    assert CoreClaims(tmp_path).worker_cores() == [c for c in cores if c != ray]
    assert node_cores.main(["--reserve", str(len(cores)), "--claims-dir", str(tmp_path)]) == 2
    assert "reserve" in capsys.readouterr().err
