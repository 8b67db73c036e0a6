"""`pdcluster gateway --autoscale` on one of two gateways of a `pdcluster cluster up` cluster:
the workers it adds and drains are routed to and left by the other gateway too (through the
cluster record: deploy.membership), under a `pdcluster bench` load on the other gateway only
that steps up and back down, and no request fails."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.chaos.test_gateway_death import BIN, Gateway, pdcluster, status
from tests.integration.test_autoscale import (INPUT_LEN, INTERVAL_S, OUTPUT_LEN, SLO_TBT_MS,
                                              SLO_TTFT_S, STEPS)
from tests.markers import starts
from tests.serve_process import free_port

pytestmark = pytest.mark.slow

# the load of the one-gateway test, on either side of the machine's capacity
SLO = ("--slo-ttft-s", str(SLO_TTFT_S), "--slo-tbt-ms", str(SLO_TBT_MS))
SETTLE_S = 150.0


@pytest.fixture(scope="module")
@starts("ray", "server")
def small_cluster(tmp_path_factory):
    """`pdcluster cluster up`: 1 prefill + 1 decode on a local Ray of its own."""
    state = tmp_path_factory.mktemp("state")
    env = {**os.environ, "PDCLUSTER_STATE_DIR": str(state)}
    env.pop("RAY_ADDRESS", None)
    namespace = f"pdcluster-autoscale-{os.getpid()}"
    up = pdcluster(env, "cluster", "up", "--ray-namespace", namespace, timeout=240)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
    try:
        yield env, namespace
    finally:
        down = pdcluster(env, "cluster", "down", "--ray-namespace", namespace, timeout=120)
        assert down.returncode == 0, down.stderr[-3000:]


def test_workers_a_scaling_gateway_adds_are_routed_to_by_every_gateway(small_cluster, tmp_path):
    env, namespace = small_cluster
    scaler = Gateway(env, namespace, free_port(), tmp_path / "scaler.log",
                     ("--autoscale", "prefill=1:2,decode=1:2", "--autoscale-interval-s",
                      str(INTERVAL_S), *SLO))
    plain = Gateway(env, namespace, free_port(), tmp_path / "plain.log", SLO)
    steps: dict[str, int] = {}  # worker -> the most engine steps seen it run
    # one `cluster status --watch` for the whole test, not a process (Ray's join, the actor
    # classes' imports) a second beside the load
    status_watch = subprocess.Popen(
        [str(BIN / "pdcluster"), "cluster", "status", "--json", "--watch", "1",
         "--ray-namespace", namespace], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)

    def watch() -> None:
        for line in status_watch.stdout:
            for w in json.loads(line)["workers"]:
                steps[w["instance"]] = max(steps.get(w["instance"], 0), w["steps_total"] or 0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        bench = subprocess.run(
            [str(BIN / "pdcluster"), "bench", "run", "--port", str(plain.port),
             "--rate-steps", STEPS, "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
             "--disable-tqdm", "--no-report", "--result-dir", str(tmp_path),
             "--result-filename", "bench.json"],
            env=env, capture_output=True, text=True, timeout=600, check=False)
        assert bench.returncode == 0, bench.stderr[-3000:]
        result = json.loads((tmp_path / "bench.json").read_text())
        assert result["failed"] == 0 and result["completed"] == result["num_prompts"] > 0

        deadline = time.time() + SETTLE_S
        while True:  # until as many stopped as were added, per role, and nothing drains
            state = httpx.get(f"{scaler.url}/health", timeout=10).json()["autoscale"]
            stopped = [e for e in state["events"] if e["action"] == "stopped"]
            ready = Counter(e["role"] for e in state["events"] if e["action"] == "ready")
            if (stopped and Counter(e["role"] for e in stopped) == ready
                    and not state["draining"]) or time.time() > deadline:
                break
            time.sleep(INTERVAL_S)
    finally:
        status_watch.terminate()
        status_watch.wait(timeout=30)
        watcher.join(timeout=30)
        scaler.stop()
        plain.stop()
    events = state["events"]
    added = [e["worker_id"] for e in events if e["action"] == "ready"]
    assert added and stopped, (events, scaler.log.read_text()[-3000:])
    assert not any(e["action"] == "failed" for e in events), events
    # the other gateway routed to what the scaler added: only it had load
    assert all(steps.get(w, 0) > 0 for w in added), (added, steps)
    joined = plain.log.read_text()
    assert all(f"worker {w} joined the cluster" in joined for w in added)
    assert all(f"worker {e['worker_id']} left the cluster" in joined for e in stopped)
    # the record lists what runs: one worker per role after the scale-down, none draining
    workers = status(env, namespace)["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"], workers
    assert {e["worker_id"] for e in stopped}.isdisjoint(w["instance"] for w in workers)
