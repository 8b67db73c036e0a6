import pytest

from router.conductor import Conductor, Instance, InstanceRegistry, NoInstanceError, RouteRequest


def test_round_robin_cycles_each_role_independently():
    registry = InstanceRegistry()
    for i in range(2):
        registry.add(Instance(f"p{i}", "prefill", None))
    for i in range(3):
        registry.add(Instance(f"d{i}", "decode", None))
    conductor = Conductor(registry, "round_robin")
    picks = [conductor.route(RouteRequest(str(n), (1,))) for n in range(6)]
    assert [p.worker_id for p, _ in picks] == ["p0", "p1"] * 3
    assert [d.worker_id for _, d in picks] == ["d0", "d1", "d2"] * 2


def test_no_instance_and_unknown_policy():
    registry = InstanceRegistry()
    registry.add(Instance("p0", "prefill", None))
    with pytest.raises(NoInstanceError):
        Conductor(registry).route(RouteRequest("r", (1,)))
    with pytest.raises(ValueError, match="unknown policy"):
        Conductor(registry, "magic")
