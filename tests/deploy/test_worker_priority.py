"""The engines of the local Ray cluster run at the gateway's priority, not at Ray's default
worker niceness of 15 (deploy/local_ray.py)."""

from __future__ import annotations

import psutil
import pytest

from tests.security.conftest import serve  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def test_engine_workers_run_at_the_gateways_niceness(serve):  # noqa: F811
    served = serve()
    gateway = psutil.Process(served.proc.pid)
    engines = [p for p in served.tree if p.name().startswith(("ray::PrefillWorker",
                                                               "ray::DecodeWorker"))]
    assert engines, [p.name() for p in served.tree]  # not vacuous
    assert {p.nice() for p in engines} == {gateway.nice()}
