"""Chaos with `--colocated`: a decode instance that prefills its own requests is
killed -9 under 16 streaming requests; they move to the other instance (ColocatedPipeline
re-prefills prompt + streamed tokens there) and end with their no-fault output."""

from __future__ import annotations

import pytest

from tests.chaos.conftest import NUM_REQUESTS, ChaosEnv

pytestmark = pytest.mark.slow


def test_killed_colocated_decode_costs_no_request(colocated_env: ChaosEnv):
    no_fault = colocated_env.run("colocated, no fault")
    assert no_fault.completed == NUM_REQUESTS
    fault, victim = colocated_env.kill_busiest("decode")
    report = colocated_env.run("colocated decode actor killed", fault, NUM_REQUESTS * 8)
    assert report.lost == 0 and report.completed == NUM_REQUESTS, str(report)
    assert report.migrations > 0
    for i, (got, want) in enumerate(zip(report.outcomes, no_fault.outcomes)):
        assert (got.token_ids, got.text) == (want.token_ids, want.text), f"request {i}"
    colocated_env.wait_rejoined("decode", 2)
    [instance] = [i for i in colocated_env.cluster.decode if i.worker_id == victim["worker_id"]]
    assert colocated_env.pid_of(instance) != victim["pid"]
    colocated_env.settle(roles=("decode",))
