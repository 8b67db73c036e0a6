"""deploy/ray_session.py: the node's CPU plan and the Ray a deployment runs on, both made
before torch is imported, so that `pdcluster serve` overlaps Ray's start with its imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.ray_session import cpu_plan
from pdcluster.engine import cpu_binding

ROOT = Path(__file__).resolve().parents[2]


def test_config_and_cpu_plan_load_no_torch():
    code = ("import sys\n"
            "from pdcluster.deploy.config import load_config\n"
            "from pdcluster.deploy.ray_session import RaySession, cpu_plan\n"
            "cpu_plan(load_config(None, {}))\n"
            "print(sorted(m for m in ('torch', 'kernels', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "[]"


def test_cpu_plan_keeps_an_explicit_binding_and_a_joined_cluster_s():
    assert cpu_plan(ServeConfig(cpu_bind="none")) == ("none", None)
    assert cpu_plan(ServeConfig(cpu_bind="0")) == ("0", None)
    assert cpu_plan(ServeConfig(address="127.0.0.1:6379")) == (cpu_binding.AUTO, None)


def test_cpu_plan_pins_nothing_when_the_threads_outnumber_the_cores():
    cores = len(os.sched_getaffinity(0))
    config = ServeConfig(engine={"torch_threads": cores})  # prefill + decode: 2x the cores
    assert cpu_plan(config) == (cpu_binding.NONE, None)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 3, reason="needs a core beyond the workers'")
def test_cpu_plan_sets_the_other_cores_aside_for_ray():
    cores = sorted(os.sched_getaffinity(0))
    workers, ray_cpus = cpu_plan(ServeConfig())  # two workers, one thread each
    assert len(cpu_binding.parse_cpu_list(workers)) == 2
    assert sorted(cpu_binding.parse_cpu_list(workers) + ray_cpus) == cores


def test_serve_closes_its_ray_session_when_the_gateway_cannot_import(monkeypatch):
    from pdcluster.deploy import cli
    from pdcluster.deploy.ray_session import RaySession

    class Opened:  # stands in for a started Ray: this test is about the CLI's error path
        closed = False

        def close(self):
            Opened.closed = True

    monkeypatch.setattr(RaySession, "open", classmethod(lambda cls, config: Opened()))
    monkeypatch.setitem(sys.modules, "pdcluster.deploy.serve", None)  # its import now fails
    with pytest.raises(ImportError, match="pdcluster.deploy.serve"):
        cli._serve(ServeConfig())
    assert Opened.closed
