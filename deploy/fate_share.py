"""Fate sharing between `pdcluster serve` and the local Ray cluster it starts.

Ray's processes run no code of ours when their driver is SIGKILLed: GCS and raylet notice and
exit, but the raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``, the latter
still listening) outlive it by a long while, and the node's shared-memory arena stays in
``/dev/shm``. So the driver starts a :class:`Guardian` first: a small stdlib-only child process
that waits on a pipe whose only write end the driver holds. End of file means the driver closed
it (:meth:`Guardian.close`, after ``ray.shutdown``) or died, however it died (the kernel closes
a dead process's descriptors). The guardian then kills every process of that Ray cluster still
running, unlinks arenas whose owner is dead (kvstore/arena/segment.py), and exits. After a clean
``ray.shutdown`` it finds nothing to kill.

Which processes are the cluster's (Ray re-parents them to init, and pids get reused):

- those whose environment holds ``PDCLUSTER_CLUSTER_ID=<this cluster's random id>``: the driver
  sets it only around ``ray.init`` (:meth:`Guardian.marked_environment`), and everything Ray
  starts inherits it (GCS, raylet, monitor, workers and what they spawn). Not enough alone:
  setting their process title, the raylet's Python agents overwrite part of the environment
  block that ``/proc/PID/environ`` shows, the mark with it now and then;
- those writing into the cluster's session directory (``/tmp/ray/session_…``; every Ray
  process, agents included, holds its log files there open for writing; a reader such as
  ``tail -f`` does not count), once the driver has told the guardian where it is
  (:meth:`Guardian.watch_session`);
- children of either.

The driver and the guardian are never killed. Each kill goes through a pidfd opened on the
process found, after checking that its start time is still the one seen, so a reused pid is
never hit. Linux only (``/proc``, pidfds); elsewhere no guardian starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: The environment variable marking the processes of one local Ray cluster.
CLUSTER_ID_ENV = "PDCLUSTER_CLUSTER_ID"
#: How long the guardian keeps killing (new workers may still be forked meanwhile) and waiting
#: for the killed to exit, before it reclaims arenas and gives up.
SWEEP_DEADLINE_S = 7.0
#: How long close() waits for the guardian to finish its sweep.
CLOSE_TIMEOUT_S = 15.0

_PROC = "/proc"


class GuardianError(RuntimeError):
    """The guardian process could not be started."""


def supported() -> bool:
    """Whether this platform can run a guardian (Linux: /proc and pidfds)."""
    return (sys.platform.startswith("linux") and os.path.isdir(_PROC)
            and hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"))


class Guardian:
    """The driver's handle on its guardian process.

    Use :meth:`start`, then wrap ``ray.init`` in :meth:`marked_environment`, pass the session
    directory to :meth:`watch_session`, and call :meth:`close` after ``ray.shutdown``.
    """

    def __init__(self, proc: subprocess.Popen, cluster_id: str) -> None:
        self._proc = proc
        self.cluster_id = cluster_id

    @classmethod
    def start(cls) -> "Guardian":
        """Start a guardian for a new cluster id (its own session, so a signal to the driver's
        process group, such as a terminal's Ctrl-C, leaves it to clean up after the driver).

        Raises:
            GuardianError: the platform is unsupported or the process did not start.
        """
        if not supported():
            raise GuardianError("a guardian needs Linux /proc and pidfds")
        cluster_id = secrets.token_hex(8)
        env = {k: v for k, v in os.environ.items() if k != CLUSTER_ID_ENV}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdcluster.deploy.fate_share", cluster_id,
                 str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, close_fds=True,
                start_new_session=True)
        except OSError as e:
            raise GuardianError(f"cannot start the guardian process: {e}") from e
        return cls(proc, cluster_id)

    @property
    def pid(self) -> int:
        """The guardian's process id."""
        return self._proc.pid

    @contextlib.contextmanager
    def marked_environment(self) -> Iterator[None]:
        """Processes started inside this block (``ray.init``'s) carry this cluster's mark; the
        previous environment is restored afterwards, so later children are not marked."""
        previous = os.environ.get(CLUSTER_ID_ENV)
        os.environ[CLUSTER_ID_ENV] = self.cluster_id
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(CLUSTER_ID_ENV, None)
            else:
                os.environ[CLUSTER_ID_ENV] = previous

    def watch_session(self, session_dir: str) -> None:
        """Tell the guardian the cluster's Ray session directory."""
        self._send(f"session {os.path.realpath(session_dir)}\n")  # as /proc/PID/fd shows it

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Let the guardian sweep what is left of the cluster and exit; wait at most
        ``timeout_s`` seconds for it (then leave it running: it exits by itself). Idempotent."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except OSError:
                pass  # it is gone already
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the cluster guardian (pid %d) has not finished within %.0f s",
                        self._proc.pid, timeout_s)

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write(line.encode())
            self._proc.stdin.flush()
        except (OSError, ValueError) as e:  # ValueError: closed
            log.warning("the cluster guardian is gone (%s): no clean-up if this process dies", e)


# -- the guardian process -------------------------------------------------------------------


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    start_ticks: int  # /proc/PID/stat field 22: tells a process from a later one of the same pid


def _stat(pid: int) -> _Proc | None:
    """The process, or None when it is gone or a zombie (which holds nothing any more)."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return _Proc(pid, int(fields[1]), int(fields[19]))


def _is_marked(pid: int, marker: bytes) -> bool:
    try:
        with open(f"{_PROC}/{pid}/environ", "rb") as f:
            return marker in b"\0" + f.read()
    except OSError:
        return False  # gone, or another user's


def _writes_under(pid: int, directory: str) -> bool:
    """Whether the process holds a file under `directory` open for writing."""
    fd_dir = f"{_PROC}/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            if not os.readlink(f"{fd_dir}/{fd}").startswith(directory):
                continue
            with open(f"{_PROC}/{pid}/fdinfo/{fd}") as info:
                flags = next(int(line.split()[1], 8) for line in info
                             if line.startswith("flags:"))
        except (OSError, StopIteration, ValueError):
            continue
        if flags & os.O_ACCMODE != os.O_RDONLY:
            return True
    return False


def cluster_processes(cluster_id: str, session_dir: str | None,
                      exclude: frozenset[int] = frozenset()) -> list[_Proc]:
    """The live processes of the cluster (see the module docstring), minus `exclude`."""
    marker = f"\0{CLUSTER_ID_ENV}={cluster_id}\0".encode()
    prefix = session_dir.rstrip("/") + "/" if session_dir else None
    procs = []
    for name in os.listdir(_PROC):
        if name.isdigit() and (p := _stat(int(name))) is not None:
            procs.append(p)
    members = {p.pid for p in procs if p.pid not in exclude and (
        _is_marked(p.pid, marker) or (prefix is not None and _writes_under(p.pid, prefix)))}
    grew = True
    while grew:  # children of members, however deep
        new = {p.pid for p in procs
               if p.ppid in members and p.pid not in members and p.pid not in exclude}
        members |= new
        grew = bool(new)
    return [p for p in procs if p.pid in members]


def kill_cluster(cluster_id: str, session_dir: str | None, exclude: frozenset[int],
                 deadline_s: float = SWEEP_DEADLINE_S) -> int:
    """SIGKILL the cluster's processes until none is left or `deadline_s` passes, waiting for
    the killed to exit (their locks and ports are free then). Returns how many were killed."""
    deadline = time.monotonic() + deadline_s
    killed = 0
    while time.monotonic() < deadline:
        found = cluster_processes(cluster_id, session_dir, exclude)
        if not found:
            break
        pidfds = []
        signalled = 0
        for p in found:
            try:
                pidfd = os.pidfd_open(p.pid)
            except OSError:
                continue  # gone
            again = _stat(p.pid)
            if again is None or again.start_ticks != p.start_ticks:
                os.close(pidfd)  # exited meanwhile, or the pid is another process's now
                continue
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                os.close(pidfd)  # not ours to kill after all (EPERM)
                continue
            signalled += 1
            pidfds.append(pidfd)
        killed += signalled
        poller = select.poll()
        for fd in pidfds:
            poller.register(fd, select.POLLIN)  # readable once the process has exited
        pending = len(pidfds)
        while pending and time.monotonic() < deadline:
            ready = poller.poll(max(1, int((deadline - time.monotonic()) * 1000)))
            for fd, _ in ready:
                poller.unregister(fd)
                pending -= 1
        for fd in pidfds:
            os.close(fd)
        if not signalled:
            time.sleep(0.1)  # only unkillable ones left: rescan now and then, not in a spin
    return killed


def _guard(cluster_id: str, driver_pid: int) -> None:
    """Wait for EOF on stdin (reading `session DIR` lines meanwhile), then clean up."""
    session_dir = None
    for raw in sys.stdin.buffer:
        line = raw.decode(errors="replace").rstrip("\n")
        if line.startswith("session "):
            session_dir = line[len("session "):]
    killed = kill_cluster(cluster_id, session_dir, frozenset({os.getpid(), driver_pid}))
    from pdcluster.kvstore.arena.segment import reclaim_dead_segments  # only now: keep idling light

    reclaimed = reclaim_dead_segments()
    if killed or reclaimed:
        log.warning("the driver (pid %d) is gone: killed %d process(es) of its Ray cluster, "
                    "reclaimed %d shared-memory arena(s)", driver_pid, killed, len(reclaimed))


def main(argv: list[str]) -> int:
    """``python -m deploy.fate_share CLUSTER_ID DRIVER_PID``, started by Guardian.start."""
    # the driver decides when to stop: a terminal's Ctrl-C or hang-up must not end the guard
    # before the driver's own drain is over
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s guardian: %(message)s")
    _guard(argv[1], int(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
