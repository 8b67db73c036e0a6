"""Global KV index: one suite over the memory, Redis (a real server) and Ray actor backends."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from pdcluster.engine.core.kv_events import AllCleared, BlockRemoved, BlockStored
from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.kvstore.index import KVIndex, Location, MemoryIndex, open_index
from tests.markers import starts

NODE_A, NODE_B = "node-a", "node-b"
DEV_A0 = Location(NODE_A, "device", "prefill-0")
DEV_A1 = Location(NODE_A, "device", "decode-0")
HOST_A = Location(NODE_A, "host")
HOST_B = Location(NODE_B, "host")
SSD_B = Location(NODE_B, "ssd")
RAY_NS = "pdcluster-index-test"


def make_keys(num_blocks: int, salt: str = "") -> list[bytes]:
    return block_keys(list(range(16 * num_blocks)), 16, make_namespace("test-model", salt))


@pytest.fixture(scope="module")
@starts("ray")
def ray_cluster():
    from tests.real_parts import import_real_part

    ray = import_real_part("ray", "Ray")
    if ray.is_initialized():  # the session's cluster fixture already runs a local Ray
        yield ray
        return
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def actor_url(ray_cluster):
    """One index actor for the module's parametrized tests (each clears it after itself)."""
    from pdcluster.kvstore.index import get_or_create_index_actor

    name = f"test-index-{uuid.uuid4().hex[:8]}"
    actor = get_or_create_index_actor(name, RAY_NS)
    yield f"ray://{name}"
    ray_cluster.kill(actor)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.server),
                        pytest.param("actor", marks=[pytest.mark.slow, pytest.mark.ray])])
def index(request) -> KVIndex:
    if request.param == "memory":
        idx: KVIndex = open_index("memory://")
    elif request.param == "redis":
        server = request.getfixturevalue("redis_server")
        idx = open_index(server.url, namespace=f"test-{uuid.uuid4().hex[:8]}")
    else:
        idx = open_index(request.getfixturevalue("actor_url"), namespace=RAY_NS)
    yield idx
    idx.clear()
    idx.close()


def heartbeat_all(index: KVIndex, lease_s: float = 30.0) -> None:
    index.heartbeat(NODE_A, lease_s)
    index.heartbeat(NODE_B, lease_s)


def test_add_lookup_remove(index):
    heartbeat_all(index)
    keys = make_keys(4)
    index.add(keys[:3], HOST_B)
    index.add(keys[:2], DEV_A0)
    index.add(keys[:2], DEV_A0)  # idempotent
    index.add(keys[1:2], SSD_B)
    assert index.lookup(keys) == [[DEV_A0, HOST_B], [DEV_A0, HOST_B, SSD_B], [HOST_B], []]

    index.remove(keys[:1] + make_keys(1, "other"), HOST_B)  # an unknown key is ignored
    index.remove(keys, HOST_A)                              # so is a location holding nothing
    assert index.lookup(keys) == [[DEV_A0], [DEV_A0, HOST_B, SSD_B], [HOST_B], []]
    assert index.lookup([]) == [] and index.longest_prefix([]) == []
    index.add([], HOST_A)
    index.remove([], HOST_A)


def test_longest_prefix_stops_at_first_gap(index):
    heartbeat_all(index)
    keys = make_keys(6)
    index.add(keys[:2] + keys[3:], HOST_A)  # block 2 missing
    index.add(keys[:1], DEV_A1)
    assert index.longest_prefix(keys) == [[DEV_A1, HOST_A], [HOST_A]]
    assert index.longest_prefix(keys[3:]) == [[HOST_A]] * 3
    assert index.longest_prefix(make_keys(3, "other")) == []
    index.add(keys[2:3], SSD_B)
    assert index.longest_prefix(keys) == [[DEV_A1, HOST_A], [HOST_A], [SSD_B]] + [[HOST_A]] * 3


def test_dead_nodes_are_ignored_until_they_heartbeat_again(index):
    keys = make_keys(3)
    index.add(keys, HOST_A)
    index.add(keys[:1], HOST_B)
    assert index.lookup(keys) == [[], [], []]  # no node ever heartbeated: all dead

    index.heartbeat(NODE_A, 0.5)
    index.heartbeat(NODE_B, 30.0)
    assert index.longest_prefix(keys) == [[HOST_A, HOST_B], [HOST_A], [HOST_A]]
    time.sleep(0.7)  # NODE_A's lease (0.5 s) ran out
    assert index.lookup(keys) == [[HOST_B], [], []]
    assert index.longest_prefix(keys) == [[HOST_B]]
    index.heartbeat(NODE_A, 0.5)  # entries stayed stored: they come back
    assert index.longest_prefix(keys) == [[HOST_A, HOST_B], [HOST_A], [HOST_A]]


def test_apply_events(index):
    heartbeat_all(index)
    keys = make_keys(5)
    index.add(keys[:2], HOST_B)  # another location: untouched by DEV_A0's events
    index.apply_events(DEV_A0, [BlockStored(tuple(keys[:4])), BlockRemoved(tuple(keys[1:2]))])
    assert index.lookup(keys) == [[DEV_A0, HOST_B], [HOST_B], [DEV_A0], [DEV_A0], []]
    index.apply_events(DEV_A0, [AllCleared(), BlockStored(tuple(keys[4:]), parent_key=keys[3])])
    assert index.lookup(keys) == [[HOST_B], [HOST_B], [], [], [DEV_A0]]
    index.apply_events(DEV_A0, [BlockStored(tuple(keys[:1])), AllCleared()])
    assert index.lookup(keys) == [[HOST_B], [HOST_B], [], [], []]
    index.apply_events(DEV_A0, [])

    with pytest.raises(TypeError):  # validated first: nothing applied
        index.apply_events(DEV_A0, [BlockStored(tuple(keys)), "not an event"])
    with pytest.raises(ValueError):
        index.apply_events(DEV_A0, [BlockStored(tuple(keys)), BlockStored((b"short",))])
    assert index.lookup(keys) == [[HOST_B], [HOST_B], [], [], []]


def test_remove_location_leaves_other_locations(index):
    heartbeat_all(index)
    keys = make_keys(3)
    for location in (DEV_A0, DEV_A1, HOST_A):
        index.add(keys, location)
    index.remove_location(DEV_A0)
    assert index.lookup(keys) == [[DEV_A1, HOST_A]] * 3
    index.remove_location(DEV_A0)  # nothing left there: no-op
    index.remove_location(HOST_A)
    index.add(keys[:1], HOST_A)  # the location can publish again
    assert index.lookup(keys) == [[DEV_A1, HOST_A], [DEV_A1], [DEV_A1]]


def test_lease_must_be_positive(index):
    with pytest.raises(ValueError):
        index.heartbeat(NODE_A, 0)


def test_clear(index):
    heartbeat_all(index)
    keys = make_keys(2)
    index.add(keys, HOST_A)
    index.clear()
    assert index.lookup(keys) == [[], []]
    index.add(keys[:1], HOST_A)  # the leases went too: NODE_A is dead until it heartbeats
    assert index.lookup(keys) == [[], []]
    heartbeat_all(index)
    assert index.lookup(keys) == [[HOST_A], []]  # the cleared entry stays gone


def test_concurrent_writers(index):
    heartbeat_all(index)
    keys = make_keys(64)
    locations = [Location(NODE_A, "device", f"worker-{i}") for i in range(6)]

    def churn(location: Location) -> None:
        for round_ in range(5):
            index.add(keys, location)
            index.remove(keys[round_::5], location)
        index.remove_location(location)
        index.add(keys[:32], location)

    threads = [threading.Thread(target=churn, args=(loc,)) for loc in locations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert index.lookup(keys) == [sorted(locations, key=Location.sort_key)] * 32 + [[]] * 32


def test_location_and_key_validation():
    with pytest.raises(ValueError):
        Location(NODE_A, "gpu")
    with pytest.raises(ValueError):
        Location(NODE_A, "device")  # device needs its instance
    with pytest.raises(ValueError):
        Location("a|b", "host")
    with pytest.raises(ValueError):
        Location("", "host")
    assert Location.decode(DEV_A0.encode()) == DEV_A0
    assert Location.decode(HOST_A.encode()) == HOST_A
    with pytest.raises(ValueError):
        MemoryIndex().add([b"not a sha256 key"], HOST_A)


def test_open_index_dispatch(redis_server):
    assert isinstance(open_index("memory://"), MemoryIndex)
    from pdcluster.kvstore.index import RedisIndex
    with open_index(redis_server.url, namespace="dispatch") as idx:
        assert isinstance(idx, RedisIndex) and idx.namespace == "dispatch"
    with pytest.raises(ValueError):
        open_index("etcd://localhost")


@pytest.mark.slow
def test_actor_index_is_shared_by_name_and_restarts_empty(ray_cluster):
    """The embedded default: clients opening the same ray:// name share one actor. If the
    actor dies it restarts empty (like Redis without persistence); a killed-for-good actor
    makes calls raise KVIndexUnavailableError."""
    from pdcluster.kvstore.index import KVIndexUnavailableError

    url = f"ray://test-index-{uuid.uuid4().hex[:8]}"
    one, two = open_index(url, namespace=RAY_NS), open_index(url, namespace=RAY_NS, timeout_s=5)
    keys = make_keys(2)
    one.heartbeat(NODE_A, 30.0)
    one.add(keys, HOST_A)
    assert two.longest_prefix(keys) == [[HOST_A]] * 2

    ray_cluster.kill(one._actor, no_restart=False)  # asynchronous, like the kill below
    deadline = time.monotonic() + 30
    while True:
        try:
            if two.lookup(keys) == [[], []]:
                break
        except KVIndexUnavailableError:
            pass
        assert time.monotonic() < deadline, "the index actor did not restart empty"
        time.sleep(0.2)
    two.add(keys, HOST_A)  # the restarted actor lost NODE_A's lease too
    assert two.lookup(keys) == [[], []]

    ray_cluster.kill(one._actor)
    with pytest.raises(KVIndexUnavailableError):
        while time.monotonic() < deadline:
            two.lookup(keys)
            time.sleep(0.1)
