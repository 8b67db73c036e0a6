"""`pdcluster serve --autoscale` under a load from `pdcluster bench` that steps up and back
down: an instance is added soon after the SLO breaks, one is drained and stopped after the
load falls, and no request fails.

The two rates sit far on either side of any 2-core machine's capacity, so the test does not
depend on how fast this one is: at 1 request/s a 384-token prompt's TTFT and the TPOT of 16
tokens stay well under the SLOs (a few per cent of a core's time); 48/s of 384-token prompts
is more than the prefill can take while the gateway and the client share its 2 cores, so the
prefill queue grows past the TTFT SLO within seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

# its rates straddle the capacity of a machine whose cores it has: run alone (scripts/test.sh)
pytestmark = pytest.mark.exclusive

INTERVAL_S = 3.0
SLO_TTFT_S, SLO_TBT_MS = 0.5, 30.0
STEPS = "1:10,48:10,1:30"
#: within the bundled model's 512 tokens; few output chunks, so a client sharing the 2 cores
#: keeps up with its own schedule
INPUT_LEN, OUTPUT_LEN = 384, 16
HIGH_STEP_END_S = 20.0  # from the load's start
SETTLE_S = 120.0  # after the load: until the planner has drained back to the minimum


def health(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()


def test_autoscale_adds_within_two_intervals_and_drains_after_with_no_failed_request(
        serve_process, tmp_path):
    _, port, log = serve_process(
        "--autoscale", "prefill=1:2,decode=1:2", "--autoscale-interval-s", str(INTERVAL_S),
        "--slo-ttft-s", str(SLO_TTFT_S), "--slo-tbt-ms", str(SLO_TBT_MS))
    bench = subprocess.run(
        [str(Path(sys.executable).parent / "pdcluster"), "bench", "run", "--port", str(port),
         "--rate-steps", STEPS, "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
         "--disable-tqdm",
         "--no-report", "--result-dir", str(tmp_path), "--result-filename", "bench.json"],
        capture_output=True, text=True, timeout=600, check=False)
    assert bench.returncode == 0, bench.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    errors = [(r["index"], round(r["start_s"], 1), r["error"]) for r in result["requests"]
              if r["error"]]
    assert result["completed"] == result["num_prompts"] > 0 and result["failed"] == 0, (
        errors, log.read_text()[-4000:])

    deadline = time.time() + SETTLE_S
    state = health(port)["autoscale"]
    while time.time() < deadline and not (
            any(e["action"] == "stopped" for e in state["events"]) and not state["draining"]):
        time.sleep(INTERVAL_S)
        state = health(port)["autoscale"]
    events = state["events"]
    actions = [(e["action"], e["role"]) for e in events]
    assert any(a == "ready" for a, _ in actions), (actions, log.read_text()[-3000:])
    assert any(a == "stopped" for a, _ in actions), actions
    assert not any(a == "failed" for a, _ in actions), events

    # the breach as the client saw it: the first request over either SLO, on the wall clock
    t0 = result["started_at"]
    over = [t0 + r["start_s"] + r["ttft_s"] for r in result["requests"]
            if r["ttft_s"] > SLO_TTFT_S]
    over += [t0 + r["start_s"] + r["e2el_s"] for r in result["requests"]
             if r["output_tokens"] > 1 and (r["e2el_s"] - r["ttft_s"])
             / (r["output_tokens"] - 1) > SLO_TBT_MS / 1000]
    assert over, "the high step broke no SLO: the test's load is too light for this machine"
    first_add = min(e["at"] for e in events if e["action"] == "add")
    first_ready = min(e["at"] for e in events if e["action"] == "ready")
    print(f"breach seen by the client -> first add {first_add - min(over):.1f} s, -> its "
          f"worker routed to {first_ready - min(over):.1f} s; events: "
          f"{[(round(e['at'] - t0, 1), e['action'], e['role']) for e in events]}")
    assert first_add - min(over) <= 2 * INTERVAL_S, (first_add - min(over), events)
    # and it was added while the high step ran: the low step alone breaks nothing
    low_end = t0 + 10
    assert first_add > low_end

    # every instance it added or drained is accounted for: started ones answered, drained
    # ones stopped only after the load fell, and what serves now is within the range
    for e in events:
        if e["action"] == "drain":
            assert e["at"] > t0 + HIGH_STEP_END_S - 2 * INTERVAL_S, e
    assert not state["draining"] and state["starting"] == {"prefill": 0, "decode": 0}
