"""Reclaiming host-arena segments whose owner died (kvstore/arena/segment.py): real owners in
other processes, SIGKILLed or alive, and real /dev/shm segments."""

from __future__ import annotations

import fcntl
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdcluster.kvstore.arena import HostArena
from pdcluster.kvstore.arena.segment import SHM_DIR, reclaim_dead_segments

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs Linux /dev/shm")

ROOT = Path(__file__).resolve().parents[2]
NODE = "r" + secrets.token_hex(4)[:7]  # this module's segments are pdc-{NODE}-*
PREFIX = f"pdc-{NODE}-"
B = 4096

# An arena owner in its own process: prints its segment name, then closes it cleanly when
# told "close" on stdin. It takes its segment off the resource tracker, as happens to a Ray
# worker (Ray kills the worker's process group, tracker included): the tracker would otherwise
# unlink it on the owner's death and hide whether reclaiming works.
OWNER = """
import sys
from multiprocessing import resource_tracker
from pdcluster.kvstore.arena import HostArena
a = HostArena(4 * 4096, 4096, node_id=sys.argv[1])
resource_tracker.unregister("/" + a.shm_name, "shared_memory")
print(a.shm_name, flush=True)
if sys.stdin.readline().strip() == "close":
    resource_tracker.register("/" + a.shm_name, "shared_memory")
    a.close()
"""


def our_segments() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(PREFIX)}


class Owner:
    """An arena owner subprocess (own process group, so its resource tracker dies with it)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", OWNER, NODE], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.name = self.proc.stdout.readline().strip()
        assert self.name.startswith(PREFIX), f"owner failed to start (exit {self.proc.poll()})"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def close(self) -> int:
        self.proc.stdin.write("close\n")
        self.proc.stdin.flush()
        return self.proc.wait(timeout=30)


@pytest.fixture
def owners():
    started: list[Owner] = []

    def start() -> Owner:
        started.append(Owner())
        return started[-1]

    yield start
    for owner in started:
        owner.kill()
    for name in our_segments():  # whatever a failed test left
        (SHM_DIR / name).unlink(missing_ok=True)


def test_reclaims_the_segment_of_a_killed_owner(owners):
    owner = owners()
    owner.kill()
    assert owner.name in our_segments(), "nothing else may remove it: reclaiming must"
    assert reclaim_dead_segments(prefix=PREFIX) == [owner.name]
    assert our_segments() == set()


def test_a_live_owner_in_another_process_keeps_its_segment(owners):
    live, dead = owners(), owners()
    dead.kill()
    assert reclaim_dead_segments(prefix=PREFIX) == [dead.name]
    assert our_segments() == {live.name}
    # still usable by its owner, which unlinks it itself
    assert live.close() == 0
    assert our_segments() == set()


def test_a_live_owner_in_this_process_keeps_its_segment():
    with HostArena(4 * B, B, node_id=NODE) as arena:
        assert reclaim_dead_segments(prefix=PREFIX) == []
        assert our_segments() == {arena.shm_name}
        [slot] = arena.reserve([b"k"])  # and the arena still works
        arena.commit([b"k"], [slot])
    assert our_segments() == set()


def test_an_empty_segment_is_young_until_the_grace_period_ends():
    """Between O_EXCL and flock a creator's segment is empty and unlocked: left alone, unless
    it stays so long that its creator must have died in that window."""
    path = SHM_DIR / f"{PREFIX}empty"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        assert reclaim_dead_segments(prefix=PREFIX) == []
        assert path.exists()
        old = time.time() - 3600
        os.utime(path, (old, old))
        assert reclaim_dead_segments(prefix=PREFIX) == [path.name]
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_a_locked_unsized_segment_is_left_alone():
    """A creator holding its lock before sizing: alive, whatever the size says."""
    path = SHM_DIR / f"{PREFIX}creating"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        old = time.time() - 3600
        os.utime(path, (old, old))
        assert reclaim_dead_segments(prefix=PREFIX) == []
        assert path.exists()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def test_a_new_arena_reclaims_segments_of_dead_owners(owners):
    """What a restarted KV store, or the next `pdcluster serve`, does on its node."""
    dead = owners()
    dead.kill()
    assert dead.name in our_segments()
    with HostArena(4 * B, B, node_id=NODE) as arena:
        assert our_segments() == {arena.shm_name}
    assert our_segments() == set()
