"""The Conductor: picks the prefill and decode instance for every request.

Policies plug in behind `SchedulingPolicy` and are registered by name in POLICIES (STYLE.md
item 6: a dict, not an if/elif chain). The walking skeleton ships round robin; the KV-cache-
centric policy of Mooncake FAST'25 §4 (Algorithm 1) arrives later behind the same interface.
"""

from __future__ import annotations

import abc
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Sequence


class NoInstanceError(RuntimeError):
    """No live instance of the needed role is registered."""


@dataclass(frozen=True)
class Instance:
    """A worker the Conductor can route to. handle: the Ray actor handle."""

    worker_id: str
    role: str  # "prefill" | "decode"
    handle: Any


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at: the request id and prompt tokens."""

    request_id: str
    prompt_token_ids: tuple[int, ...]


class InstanceRegistry:
    """Live instances by role. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._instances: dict[str, Instance] = {}

    def add(self, instance: Instance) -> None:
        with self._lock:
            self._instances[instance.worker_id] = instance

    def remove(self, worker_id: str) -> None:
        with self._lock:
            self._instances.pop(worker_id, None)

    def by_role(self, role: str) -> list[Instance]:
        with self._lock:
            return [i for i in self._instances.values() if i.role == role]


class SchedulingPolicy(abc.ABC):
    @abc.abstractmethod
    def select(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        """Pick one of `candidates` (never empty) for `request`."""


class RoundRobinPolicy(SchedulingPolicy):
    """Cycles through the candidates in registration order, per role."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return candidates[next(self._counter) % len(candidates)]


POLICIES: dict[str, type[SchedulingPolicy]] = {"round_robin": RoundRobinPolicy}


class Conductor:
    """Routes each request to a (prefill, decode) pair with one policy object per role."""

    def __init__(self, registry: InstanceRegistry, policy: str = "round_robin") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
        self.registry = registry
        self._prefill_policy = POLICIES[policy]()
        self._decode_policy = POLICIES[policy]()

    def route_decode(self, request: RouteRequest) -> Instance:
        """A decode instance alone (colocated mode). Raises NoInstanceError."""
        decodes = self.registry.by_role("decode")
        if not decodes:
            raise NoInstanceError("no decode instance is live")
        return self._decode_policy.select(request, decodes)

    def route(self, request: RouteRequest) -> tuple[Instance, Instance]:
        """Returns (prefill, decode). Raises NoInstanceError when a role has no instance."""
        prefills = self.registry.by_role("prefill")
        decodes = self.registry.by_role("decode")
        if not prefills or not decodes:
            raise NoInstanceError(f"{len(prefills)} prefill and {len(decodes)} decode "
                                  "instances are live")
        return (self._prefill_policy.select(request, prefills),
                self._decode_policy.select(request, decodes))
