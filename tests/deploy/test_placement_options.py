"""deploy/placement.py's pure part: what each worker asks Ray for, and which nodes get a KV
store. (Where actors actually land: tests/multinode/test_placement.py.)"""

from __future__ import annotations

import pytest

from deploy import placement
from deploy.placement import PlacementError

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
