"""The instances the Conductor routes to, and which of them are dead.

Worker death: the request path marks an instance dead when a call to it fails with
RayActorError (its process is gone); nothing is routed to it then. Ray restarts worker actors
behind the same handle (deploy.placement.WORKER_MAX_RESTARTS), so a probe thread calls each
dead instance until it answers, and the instance rejoins.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Instance:
    """A worker the Conductor can route to. handle: the Ray actor handle."""

    worker_id: str
    role: str  # "prefill" | "decode" | "kvstore"
    handle: Any


class InstanceRegistry:
    """Instances by role, and which of them are dead. Thread-safe.

    An instance the request path saw die (a RayActorError: its process is gone) is marked
    dead: `by_role` leaves it out, so nothing is routed to it. Ray restarts a dead worker actor
    (deploy.placement.WORKER_MAX_RESTARTS) behind the same handle; a daemon thread probes each
    dead instance with `probe` every `probe_interval_s` and marks it alive again once a probe
    answers, so a restarted actor rejoins by itself.

    probe: given an Instance, starts a liveness call and returns a poll function: None while
        it runs, True when the instance answered, False when the call failed (default: the
        actor's `info()` over Ray).
    """

    def __init__(self, probe: Callable[[Instance], Callable[[], bool | None]] | None = None,
                 probe_interval_s: float = 0.25) -> None:
        self._lock = threading.Lock()
        self._instances: dict[str, Instance] = {}
        self._dead: dict[str, Callable[[], bool | None] | None] = {}  # id -> probe in flight
        self._draining: set[str] = set()  # being scaled down: serve what they hold, no more
        self._probe = probe or _ray_info_probe
        self._probe_interval_s = probe_interval_s
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._prober: threading.Thread | None = None
        self.deaths_total = 0
        self.rejoins_total = 0

    def add(self, instance: Instance) -> None:
        with self._lock:
            self._instances[instance.worker_id] = instance
            self._dead.pop(instance.worker_id, None)

    def remove(self, worker_id: str) -> None:
        with self._lock:
            self._instances.pop(worker_id, None)
            self._dead.pop(worker_id, None)
            self._draining.discard(worker_id)

    def drain(self, worker_id: str) -> None:
        """Route nothing new to `worker_id` (a scale-down); what it holds goes on."""
        with self._lock:
            if worker_id in self._instances:
                self._draining.add(worker_id)

    def by_role(self, role: str) -> list[Instance]:
        """The live instances of `role` that take new requests (not dead, not draining)."""
        with self._lock:
            return [i for i in self._instances.values()
                    if i.role == role and i.worker_id not in self._dead
                    and i.worker_id not in self._draining]

    def dead(self) -> list[str]:
        """The ids of instances marked dead and not back yet."""
        with self._lock:
            return sorted(self._dead)

    def count(self, role: str) -> int:
        """Instances of `role`, dead ones included (those may come back)."""
        with self._lock:
            return sum(i.role == role for i in self._instances.values())

    def mark_dead(self, worker_id: str) -> bool:
        """Stop routing to `worker_id` until a probe finds it back. Returns True when it was
        live until now (False: unknown or already dead)."""
        with self._lock:
            if worker_id not in self._instances or worker_id in self._dead:
                return False
            self._dead[worker_id] = None
            self.deaths_total += 1
            if self._prober is None and not self._closed.is_set():
                self._prober = threading.Thread(target=self._probe_loop, name="registry-probe",
                                                daemon=True)
                self._prober.start()
        log.warning("instance %s marked dead; probing until it is back", worker_id)
        self._wake.set()
        return True

    def mark_alive(self, worker_id: str) -> None:
        with self._lock:
            if worker_id not in self._dead:
                return
            del self._dead[worker_id]
            self.rejoins_total += 1
        log.warning("instance %s answers again: routing to it", worker_id)

    def close(self) -> None:
        """Stop the probe thread."""
        self._closed.set()
        self._wake.set()
        if self._prober is not None:
            self._prober.join(timeout=5)

    def probe_once(self) -> None:
        """One round of liveness probes over the dead instances."""
        with self._lock:
            dead = [(self._instances[w], poll) for w, poll in self._dead.items()]
        for instance, poll in dead:
            if poll is None:
                try:
                    poll = self._probe(instance)
                except Exception as exc:  # noqa: BLE001 — retried next round
                    log.debug("probe of %s not sent: %s", instance.worker_id, exc)
                    continue
            answer = poll()
            if answer:
                self.mark_alive(instance.worker_id)
                continue
            with self._lock:
                if instance.worker_id in self._dead:  # False: the call failed, send another
                    self._dead[instance.worker_id] = None if answer is False else poll

    def _probe_loop(self) -> None:
        while not self._closed.is_set():
            self.probe_once()
            self._wake.wait(self._probe_interval_s)
            self._wake.clear()


def _ray_info_probe(instance: Instance) -> Callable[[], bool | None]:
    import ray

    ref = instance.handle.info.remote()

    def poll() -> bool | None:
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return None
        try:
            ray.get(ref)
            return True
        except Exception:  # noqa: BLE001 — dead or restarting: probe again
            return False

    return poll
