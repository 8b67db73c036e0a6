"""Redis index backend specifics: key layout, round trips, namespaces, a server restart."""

from __future__ import annotations

import time

import pytest

from tests.real_parts import import_real_part

redis = import_real_part("redis", "redis-py", "scripts/setup.sh --dev installs it")
from redis.connection import AbstractConnection  # noqa: E402

from pdcluster.engine.core.kv_events import BlockStored  # noqa: E402
from pdcluster.engine.core.hashing import block_keys, make_namespace  # noqa: E402
from pdcluster.kvstore.index import KVIndexUnavailableError, Location  # noqa: E402
from pdcluster.kvstore.index.redis_index import RedisIndex  # noqa: E402

HOST_A = Location("node-a", "host")
DEV_B = Location("node-b", "device", "decode-1")


def make_keys(num_blocks: int) -> list[bytes]:
    return block_keys(list(range(16 * num_blocks)), 16, make_namespace("test-model"))


@pytest.fixture
def round_trips(monkeypatch):
    """Counts packed writes to the server: one per command outside a pipeline, one per
    pipeline (redis-py packs a whole pipeline into one send, then reads all replies)."""
    count = [0]
    original = AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):
        count[0] += 1
        return original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    return count


def test_key_layout_and_lease_ttl(redis_server):
    keys = make_keys(2)
    with RedisIndex(redis_server.url, namespace="layout") as index, \
            redis.Redis.from_url(redis_server.url) as raw:
        index.clear()
        index.heartbeat("node-b", 0.5)
        index.add(keys, DEV_B)
        assert raw.smembers(f"layout:blk:{keys[0].hex()}") == {b"node-b|device|decode-1"}
        assert raw.smembers("layout:loc:node-b|device|decode-1") == set(keys)
        assert 0 < raw.pttl("layout:node:node-b") <= 500
        index.clear()
        assert raw.keys("layout:*") == []


def test_longest_prefix_costs_at_most_two_round_trips(redis_server, round_trips):
    keys = make_keys(256)
    with RedisIndex(redis_server.url, namespace="roundtrips") as index:
        index.clear()
        for node in ("node-a", "node-b", "node-c"):
            index.heartbeat(node, 30.0)
        round_trips[0] = 0
        index.add(keys, HOST_A)
        index.apply_events(DEV_B, [BlockStored(tuple(keys[:100])), BlockStored(tuple(keys[100:]))])
        index.add(keys[:10], Location("node-c", "ssd"))
        assert round_trips[0] == 3  # each write call is one pipeline

        round_trips[0] = 0
        prefix = index.longest_prefix(keys)
        assert round_trips[0] <= 2
        assert len(prefix) == 256 and prefix[0][0] == DEV_B and len(prefix[0]) == 3

        round_trips[0] = 0
        assert len(index.lookup(keys)) == 256
        assert round_trips[0] <= 2

        round_trips[0] = 0
        assert index.longest_prefix(make_keys(300)[256:]) == []  # all misses: one round trip
        assert round_trips[0] == 1
        index.clear()


def test_namespaces_are_isolated(redis_server):
    keys = make_keys(1)
    with RedisIndex(redis_server.url, namespace="ns-one") as one, \
            RedisIndex(redis_server.url, namespace="ns-two") as two:
        for index in (one, two):
            index.clear()
            index.heartbeat("node-a", 30.0)
        one.add(keys, HOST_A)
        assert two.lookup(keys) == [[]]
        two.clear()
        assert one.lookup(keys) == [[HOST_A]]
        one.clear()
    with pytest.raises(ValueError):
        RedisIndex(redis_server.url, namespace="bad:ns")
    with pytest.raises(ValueError):
        RedisIndex(client=redis.Redis.from_url(redis_server.url, decode_responses=True))


def test_restart_empties_the_index_and_the_client_reconnects(fresh_redis_server):
    """What a caller sees: while the server is down, KVIndexUnavailableError (after redis-py's
    retries); once it is back (empty, no persistence), plain misses and no live nodes,
    with no exception: the pooled connection is re-established on the next call."""
    keys = make_keys(4)
    socket_timeout_s, retries = 0.5, 1
    with RedisIndex(fresh_redis_server.url, socket_timeout_s=socket_timeout_s,
                    retries=retries) as index:
        index.heartbeat("node-a", 30.0)
        index.add(keys, HOST_A)
        assert len(index.longest_prefix(keys)) == 4

        fresh_redis_server.stop(kill=True)
        start = time.monotonic()
        with pytest.raises(KVIndexUnavailableError):
            index.longest_prefix(keys)
        with pytest.raises(KVIndexUnavailableError):
            index.heartbeat("node-a", 30.0)
        # bounded by the configured retries: two calls of (1 + retries) attempts of at most
        # socket_timeout_s each (2 s), with a generous 10x, not a client that waits for the server
        assert time.monotonic() - start < 10 * 2 * (1 + retries) * socket_timeout_s

        fresh_redis_server.start()  # same port, empty
        assert index.lookup(keys) == [[]] * 4
        assert index.longest_prefix(keys) == []
        index.add(keys[:2], HOST_A)  # the node re-announces its blocks; its lease is gone
        assert index.longest_prefix(keys) == []
        index.heartbeat("node-a", 30.0)  # and it heartbeats again
        assert index.longest_prefix(keys) == [[HOST_A]] * 2


def test_restart_between_calls_is_invisible_but_empty(fresh_redis_server):
    """A restart that completes between two calls: the stale pooled socket fails once and
    redis-py's retry reconnects, so the caller sees no error, only an empty index."""
    keys = make_keys(2)
    with RedisIndex(fresh_redis_server.url, socket_timeout_s=0.5, retries=2) as index:
        index.heartbeat("node-a", 30.0)
        index.add(keys, HOST_A)
        fresh_redis_server.restart(kill=True)
        assert index.longest_prefix(keys) == []
        index.add(keys, HOST_A)  # the node's lease went with the data
        assert index.lookup(keys) == [[], []]
