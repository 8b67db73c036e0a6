"""Gateway replicas see each other's routing decisions (router.decision_board): what one
publishes reaches every other gateway's reader within moments, never its own, on the
embedded board (a real detached Ray actor) and on Redis (a real redis-server)."""

from __future__ import annotations

import threading
import time

import pytest

from pdcluster.router.decision_board import ActorDecisionBoard, RedisDecisionBoard, SharedDecision
from tests.kvstore.conftest import ray_cluster, redis_server  # noqa: F401 — real parts

DEADLINE_S = 30.0


class Received:
    def __init__(self) -> None:
        self.items: list[SharedDecision] = []
        self._lock = threading.Lock()

    def __call__(self, decision: SharedDecision) -> None:
        with self._lock:
            self.items.append(decision)

    def wait_for(self, count: int) -> list[SharedDecision]:
        deadline = time.monotonic() + DEADLINE_S
        while len(self.items) < count:
            assert time.monotonic() < deadline, self.items
            time.sleep(0.01)
        return list(self.items)


def boards(kind: str, redis_url: str | None):
    """Gateways' boards of one deployment (one Redis key namespace for this test)."""
    if kind == "actor":
        return lambda on_peer: ActorDecisionBoard(on_peer)
    namespace = f"test-{time.monotonic_ns()}"
    return lambda on_peer: RedisDecisionBoard(on_peer, redis_url, namespace=namespace)


@pytest.mark.parametrize("kind", ["actor", "redis"])
def test_a_decision_reaches_the_other_gateways_and_not_its_own(kind, request):
    if kind == "actor":
        request.getfixturevalue("ray_cluster")
        make = boards(kind, None)
    else:
        make = boards(kind, request.getfixturevalue("redis_server").url)
    got_a, got_b, got_c = Received(), Received(), Received()
    a, b = make(got_a).start(), make(got_b).start()
    try:
        time.sleep(0.5)  # both readers at the end of the board
        a.publish("prefill-1", 1.5)
        a.publish("prefill-0", 0.25)
        # in either order: Ray may run an async actor's calls out of submission order, and a
        # Conductor adds the decisions it reads up, so no board promises an order
        assert sorted(got_b.wait_for(2), key=lambda d: d.instance_id) == [
            SharedDecision(a.gateway, "prefill-0", 0.25),
            SharedDecision(a.gateway, "prefill-1", 1.5)]
        b.publish("prefill-0", 3.0)
        assert got_a.wait_for(1) == [SharedDecision(b.gateway, "prefill-0", 3.0)]
        # a gateway started later begins at the end: it gets what comes next, not history
        c = make(got_c).start()
        time.sleep(0.5)
        a.publish("prefill-1", 2.0)
        assert got_c.wait_for(1) == [SharedDecision(a.gateway, "prefill-1", 2.0)]
        c.stop()
        time.sleep(0.2)
        assert [d.gateway for d in got_a.items] == [b.gateway]  # never its own
        assert len(got_b.items) == 3
    finally:
        a.stop()
        b.stop()
