"""`kill -9` of `pdcluster serve`: no process of its local Ray survives it by more than 10 s,
and its shared-memory arena does not outlive the next start (deploy/fate_share.py,
kvstore/arena/segment.py). A clean SIGTERM still leaves nothing behind. The guardian is also
tested alone, without Ray, on processes it must kill and processes it must spare."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.security.conftest import (SHM_DIR, alive, describe, has_live_owner,
                                     mapped_segments, pdc_segments)

linux_only = pytest.mark.skipif(not SHM_DIR.is_dir() or not sys.platform.startswith("linux"),
                                reason="needs Linux /dev/shm, /proc and pidfds")

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0

# A host arena whose owner is SIGKILLed with its resource tracker (as Ray kills a worker's
# process group): the segment stays behind, ownerless.
DEAD_OWNER = """
import sys
from multiprocessing import resource_tracker
from pdcluster.kvstore.arena import HostArena
a = HostArena(4096, 4096, node_id=sys.argv[1])
resource_tracker.unregister("/" + a.shm_name, "shared_memory")
print(a.shm_name, flush=True)
sys.stdin.readline()
"""


def ownerless_segment() -> str:
    proc = subprocess.Popen([sys.executable, "-c", DEAD_OWNER, "x" + secrets.token_hex(3)],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        name = proc.stdout.readline().strip()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert name.startswith("pdc-") and (SHM_DIR / name).exists()
    return name


def wait_gone(procs, within_s: float) -> list:
    deadline = time.monotonic() + within_s
    while (left := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
@linux_only
def test_kill_9_leaves_no_ray_process_and_the_next_start_reclaims_the_arena(serve):
    first = serve()
    names = {entry.split(" ", 1)[1] for entry in describe(first.tree)}
    assert {"raylet", "gcs_server"} <= names, names
    first_segments = mapped_segments(first.tree)
    assert first_segments, "the KV store's arena should be mapped by the cluster"

    first.proc.kill()
    first.proc.wait(timeout=10)
    left = wait_gone(first.tree, GONE_WITHIN_S)
    assert not left, f"alive {GONE_WITHIN_S:g} s after kill -9: {describe(left)}"

    orphan = ownerless_segment()
    before = pdc_segments()
    second = serve()
    still_there = first_segments & pdc_segments()
    assert not still_there, f"the dead cluster's arena was not reclaimed: {still_there}"
    assert not (SHM_DIR / orphan).exists(), "an ownerless arena survived the next start"
    ownerless = {s for s in before if has_live_owner(s) is False}
    assert not ownerless, f"segments without a live owner after the next start: {ownerless}"
    second_segments = mapped_segments(second.tree)
    assert second_segments and all(has_live_owner(s) for s in second_segments)

    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(timeout=90) == 0, second.log_tail()
    left = wait_gone(second.tree, GONE_WITHIN_S)
    assert not left, f"alive after a clean stop: {describe(left)}"
    assert not second_segments & pdc_segments(), "a clean stop must unlink its arena"


# A driver without Ray: starts a guardian, then the kinds of processes it must tell apart,
# each in its own session (as Ray's workers are not in the driver's process group):
#   marked      -- started with the cluster's mark in its environment (what Ray starts)
#   grandchild  -- an unmarked child of `marked` (reparented when `marked` dies first)
#   writer      -- unmarked, writing into the session directory (an agent whose title
#                  overwrote its environment)
#   reader      -- unmarked, reading a file there (an operator's `tail -f`): not the cluster's
#   stranger    -- marked with another cluster's id
# The driver itself holds a session file open for writing, as Ray's driver does. It prints
# the pids, then waits: "close" on stdin closes the guardian and reports "alive". Every
# process but the guardian has the session path as its last argument, for the teardown.
DRIVER = """
import os, subprocess, sys
from pdcluster.deploy.fate_share import CLUSTER_ID_ENV, Guardian
session = sys.argv[1]
def spawn(code, env=None, stdout=None):
    return subprocess.Popen([sys.executable, "-c", code, session], start_new_session=True,
                            env=env, stdout=stdout)
own_log = open(os.path.join(session, "driver.log"), "a")
g = Guardian.start()
with g.marked_environment():
    marked = spawn("import subprocess, sys, time; "
                   "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', "
                   "sys.argv[1]], env={}); print(c.pid, flush=True); time.sleep(600)")
open(os.path.join(session, "r.log"), "w").close()
# each says when its file is open: the guardian tells them apart by their open files
writer = spawn("import sys, time; f = open(sys.argv[1] + '/w.log', 'a'); print(flush=True); "
               "time.sleep(600)", stdout=subprocess.PIPE)
reader = spawn("import sys, time; f = open(sys.argv[1] + '/r.log'); print(flush=True); "
               "time.sleep(600)", stdout=subprocess.PIPE)
writer.stdout.readline(), reader.stdout.readline()
stranger = spawn("import time; time.sleep(600)", env={**os.environ, CLUSTER_ID_ENV: "other"})
g.watch_session(session)
print(os.getpid(), g.pid, marked.pid, writer.pid, reader.pid, stranger.pid, flush=True)
if sys.stdin.readline().strip() == "close":
    g.close()
    print("alive", flush=True)
    sys.stdin.readline()
"""
CLUSTER = ("marked", "grandchild", "writer", "guardian")
SPARED = ("reader", "stranger")


@pytest.fixture
def driver(tmp_path):
    """(driver Popen, {role: psutil.Process}); teardown kills every process it started."""
    tag = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, tag], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    procs: dict[str, psutil.Process] = {}
    try:
        lines = sorted((proc.stdout.readline().split() for _ in range(2)), key=len)
        [grandchild], (pid, guardian, marked, writer, reader, stranger) = (
            list(map(int, line)) for line in lines)
        assert pid == proc.pid
        procs = {name: psutil.Process(pid) for name, pid in [
            ("guardian", guardian), ("marked", marked), ("grandchild", grandchild),
            ("writer", writer), ("reader", reader), ("stranger", stranger)]}
        yield proc, procs
    finally:
        proc.kill()
        proc.wait(timeout=10)
        tagged = [p for p in psutil.process_iter(["cmdline"])
                  if p.info["cmdline"] and p.info["cmdline"][-1] == tag]
        for p in alive(tagged + list(procs.values())):
            try:
                p.kill()
            except psutil.Error:
                pass


@linux_only
class TestGuardian:
    """The guardian alone, without Ray (fast)."""

    def test_kill_9_of_the_driver_kills_its_cluster_and_nothing_else(self, driver):
        proc, procs = driver
        proc.kill()
        proc.wait(timeout=10)
        left = wait_gone([procs[n] for n in CLUSTER], GONE_WITHIN_S)
        assert not left, f"alive {GONE_WITHIN_S:g} s after kill -9: {describe(left)}"
        assert len(alive([procs[n] for n in SPARED])) == len(SPARED)

    def test_close_sweeps_the_cluster_and_spares_the_driver(self, driver):
        proc, procs = driver
        proc.stdin.write("close\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "alive"
        assert proc.poll() is None
        assert not alive([procs[n] for n in CLUSTER])
        assert len(alive([procs[n] for n in SPARED])) == len(SPARED)
