"""deploy/placement.py's pure part: what each worker asks Ray for, and which nodes get a KV
store. (Where actors actually land: tests/multinode/test_placement.py.)"""

from __future__ import annotations

import pytest

from pdcluster.deploy import placement
from pdcluster.deploy.placement import PlacementError

ROLE_NODES = {"CPU": 8.0, "prefill": 1.0, "decode": 2.0}


def node(node_id: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 4.0, **resources}}


def test_role_demand_by_mode():
    assert placement.role_resources("prefill", "auto", ROLE_NODES) == {"prefill": 0.001}
    assert placement.role_resources("decode", "resources", ROLE_NODES) == {"decode": 0.001}
    assert placement.role_resources("decode", "none", ROLE_NODES) == {}
    assert placement.role_resources("decode", "auto", {"CPU": 8.0}) == {}  # nobody offers it
    with pytest.raises(PlacementError, match="decode"):
        placement.role_resources("decode", "resources", {"CPU": 8.0, "prefill": 1.0})
    with pytest.raises(ValueError):
        placement.role_resources("gateway", "auto", ROLE_NODES)


def test_local_ray_offers_every_role():
    local = placement.local_node_resources()
    assert all(placement.role_resources(r, "resources", local) for r in placement.ROLES)


def test_worker_options():
    opts = placement.worker_options("prefill", "auto", ROLE_NODES, 2.0)
    assert opts == {"num_cpus": 2.0, "max_restarts": -1, "resources": {"prefill": 0.001}}
    opts = placement.worker_options("decode", "none", ROLE_NODES, 1.0, num_gpus=1.0)
    assert opts == {"num_cpus": 1.0, "max_restarts": -1, "num_gpus": 1.0}


def test_kv_stores_go_where_workers_may_go():
    nodes = [node("head"), node("p", prefill=1), node("d", decode=1), node("gone", False,
                                                                          decode=1)]
    both = [{"prefill": 0.001}, {"decode": 0.001}]
    assert placement.worker_node_ids(nodes, both) == ["p", "d"]
    assert placement.worker_node_ids(nodes, [{"decode": 0.001}]) == ["d"]  # colocated
    assert placement.worker_node_ids(nodes, [{"prefill": 0.001}, {}]) == ["head", "p", "d"]
    assert placement.worker_node_ids(nodes, []) == ["head", "p", "d"]


def test_tp_rank_options_take_exactly_the_ranks_bundle_and_the_restart_policy():
    from types import SimpleNamespace

    from pdcluster.engine.tp_instance import bundle_options

    # stands in for a ray PlacementGroup: the options read only its bundle specs
    pg = SimpleNamespace(bundle_specs=[{"CPU": 1.0, "decode": 0.001},
                                       {"CPU": 2.0, "GPU": 1.0, "memory": 5.0, "decode": 0.001}])
    rank1 = placement.tp_rank_options(pg, 1)
    assert (rank1["num_cpus"], rank1["num_gpus"], rank1["resources"]) == (2.0, 1.0,
                                                                          {"decode": 0.001})
    assert rank1["max_restarts"] == placement.WORKER_MAX_RESTARTS
    strategy = rank1["scheduling_strategy"]
    assert (strategy.placement_group, strategy.placement_group_bundle_index) == (pg, 1)
    assert strategy.placement_group_capture_child_tasks
    follower = bundle_options(pg, 0)  # what a TP instance's rank 0 gives its followers
    assert "max_restarts" not in follower and "num_gpus" not in follower
    rank0 = placement.tp_rank_options(pg, 0, max_restarts=0)
    assert rank0.pop("max_restarts") == 0
    assert rank0.pop("scheduling_strategy").placement_group_bundle_index == 0
    assert rank0 == {k: v for k, v in follower.items() if k != "scheduling_strategy"}
    assert rank0 == {"num_cpus": 1.0, "resources": {"decode": 0.001}}
