"""Hung workers: alive, and making no progress (a stopped process, a stuck collective), which
neither Ray nor the request path notices (a reported vLLM problem: /health stays green).

Each worker's stats() carry its progress: steps run (``num_steps_total`` +
``num_prefill_steps_total``) and the requests it is running (``num_running``; requests that
wait for KV are waiting on something else, with timeouts of their own). A worker is declared
hung when it holds running requests and its step count has not moved for ``stall_timeout_s``,
or when it has not answered for that long while it held some at its last answer or the
gateway has requests streaming from it (a stopped process answers nothing). A hung worker is marked dead (nothing more is routed to it) and
killed: Ray restarts it behind the same handle, its requests' streams fail and migrate as for
a killed worker, and the registry's probe brings it back. A stopped process cannot take Ray's
kill request, so one on this node is also sent SIGKILL by its pid.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.router.registry import Instance, InstanceRegistry

log = logging.getLogger(__name__)

#: how many recent hung declarations /health lists
HUNG_HISTORY = 16


@dataclass
class _Progress:
    steps: int = -1
    running: int = 0
    moved_at: float = 0.0  # when steps last changed, or the worker last held nothing running
    ref: Any = None  # the stats() call in flight
    sent_at: float = 0.0
    pid: int | None = None  # the worker's process, from its stats


@dataclass(frozen=True)
class HungWorker:
    worker_id: str
    role: str
    reason: str
    at: float  # time.time()


@dataclass
class StallWatch:
    """Watches the registry's prefill and decode workers every ``interval_s`` on a daemon
    thread. kill(instance, pid): ends a hung worker's process so that Ray restarts it
    (default: ray.kill with restart, and SIGKILL to the pid when it is a Ray worker process on
    this node); busy: whether the gateway has requests on the worker now (what a worker that
    stopped answering is judged by, beside what it held at its last answer)."""

    registry: InstanceRegistry
    stall_timeout_s: float
    interval_s: float = 1.0
    kill: Callable[[Instance, int | None], None] | None = None
    busy: Callable[[Instance], bool] | None = None
    hung: list[HungWorker] = field(default_factory=list)
    hung_total: int = 0

    def __post_init__(self) -> None:
        self._progress: dict[str, _Progress] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        self._kill = self.kill or _ray_kill

    def start(self) -> StallWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def check_once(self, now: float | None = None) -> list[HungWorker]:
        """One round over the live workers; returns those declared hung in it."""
        import ray

        now = time.monotonic() if now is None else now
        found = []
        for instance in self.registry.by_role("prefill") + self.registry.by_role("decode"):
            p = self._progress.setdefault(instance.worker_id, _Progress(moved_at=now))
            reason = None
            if p.ref is not None:
                ready, _ = ray.wait([p.ref], timeout=0)
                if ready:
                    try:
                        stats = ray.get(p.ref)
                    except Exception:  # noqa: BLE001 — a dead one is the request path's
                        stats = None
                    p.ref = None
                    if stats is not None:
                        reason = self._report(p, stats, now)
                elif now - p.sent_at > self.stall_timeout_s and (
                        p.running or (self.busy is not None and self.busy(instance))):
                    reason = f"no answer for {now - p.sent_at:.0f} s while holding requests"
            if reason is None and p.ref is None:
                p.ref, p.sent_at = instance.handle.stats.remote(), now
            if reason is not None:
                found.append(self._declare(instance, reason))
        return found

    def _report(self, p: _Progress, stats: SchedulerStats, now: float) -> str | None:
        steps = stats.num_steps_total + stats.num_prefill_steps_total
        running = stats.num_running
        p.pid = stats.pid
        if steps != p.steps or not running:
            p.moved_at = now
        p.steps, p.running = steps, running
        if now - p.moved_at > self.stall_timeout_s:
            return (f"no step for {now - p.moved_at:.0f} s while running {running} requests "
                    f"(step {steps})")
        return None

    def _declare(self, instance: Instance, reason: str) -> HungWorker:
        record = HungWorker(instance.worker_id, instance.role, reason, time.time())
        log.error("%s worker %s is hung (%s): restarting it; its requests migrate",
                  instance.role, instance.worker_id, reason)
        self.hung_total += 1
        self.hung = [*self.hung, record][-HUNG_HISTORY:]
        progress = self._progress.pop(instance.worker_id, None)
        self.registry.mark_dead(instance.worker_id)
        try:
            self._kill(instance, progress.pid if progress is not None else None)
        except Exception:  # noqa: BLE001 — marked dead either way; the probe decides
            log.exception("killing hung worker %s failed", instance.worker_id)
        return record

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 — the watch must outlive one bad round
                log.exception("stall watch round failed")


def _ray_kill(instance: Instance, pid: int | None) -> None:
    import ray

    ray.kill(instance.handle, no_restart=False)
    if pid is None:
        return
    try:
        with open(f"/proc/{pid}/comm") as comm:  # Linux: the process's name
            if comm.read().startswith("ray::"):  # this node's Ray worker, not a reused pid
                os.kill(pid, signal.SIGKILL)
    except OSError:
        pass  # on another node, gone already, or no /proc
