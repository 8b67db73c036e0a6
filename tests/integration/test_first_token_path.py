"""The synchronous remote calls between a request's arrival and its first token, on the default
disaggregated path: the Conductor's index lookup, the prefill actor call, and on the prefill
worker only what the first token needs (a prefix load when the Conductor planned one).
Publishing (G2 blocks, the tail, the G1 index events) happens after the first token.

Real parts: the model, a gRPC KV store, the in-memory global index, the Conductor and its
policy; counting proxies record each call with its start time. The prefill actor call is one
Ray call by construction (router/pipeline.py: a streaming generator whose first item is the
first token), so it is counted as one here.
"""

from __future__ import annotations

import threading
import time

import pytest

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.protocol import PrefillRequest, SamplingParams
from pdcluster.engine.runner import ModelRunner
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig
from pdcluster.engine.core.kv_events import BlockStored
from pdcluster.kvstore.index import Location, MemoryIndex
from pdcluster.kvstore.transport.pool.connector import PoolConnector
from pdcluster.prefill_worker.instance import prefill_core, submit_prefill
from pdcluster.router.conductor import Conductor, PrefixKeyer, RouteRequest
from pdcluster.router.cost_model import DEFAULT_COST_MODEL, load_cost_model
from pdcluster.router.policies import DEFAULT_POLICY
from pdcluster.router.policies.live_loads import LedgerLoads
from tests.engine_loops import started, stop
from tests.kvstore.lru_block_store import lru_server
from tests.handoffs import handoff
from tests.markers import starts

NODE = "node-p"
ACTOR_CALLS = 1  # PrefillWorker.prefill's first item


class Calls:
    """Every call made through the proxies: (start time, name)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.made: list[tuple[float, str]] = []

    def before(self, t: float) -> list[str]:
        with self.lock:
            return [name for start, name in self.made if start < t]

    def after(self, t: float) -> list[str]:
        with self.lock:
            return [name for start, name in self.made if start >= t]


class Counted:
    """A proxy that records each method call on `target` (a remote client) in `calls`."""

    def __init__(self, target, label: str, calls: Calls) -> None:
        self._target, self._label, self._calls = target, label, calls

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with self._calls.lock:
                self._calls.made.append((time.monotonic(), f"{self._label}.{name}"))
            return attr(*args, **kwargs)
        return call


@pytest.fixture(scope="module")
@starts("server")
def world():
    server = lru_server(KVStoreConfig())
    server.start()
    client = KVStoreClient(server.address)
    index = MemoryIndex()
    index.heartbeat(NODE, 600.0)  # the node's lease: the index lists only live nodes' blocks
    calls = Calls()

    def build():
        runner = ModelRunner(EngineConfig(num_kv_blocks=128))
        pool = PoolConnector(NODE, Counted(client, "kv_store", calls), server.address,
                             Counted(client, "node_store", calls), Counted(index, "index", calls))
        return prefill_core(runner, pool, "p0", 0, Counted(index, "index", calls), NODE)

    engine = started(build)
    loads = LedgerLoads(load_cost_model(DEFAULT_COST_MODEL))
    loads.set_node("p0", NODE)
    conductor = Conductor(None, DEFAULT_POLICY, loads=loads,
                          index=Counted(index, "index", calls),
                          keyer=PrefixKeyer(16, engine.model_id))
    yield engine, conductor, index, client, calls
    stop(engine)
    client.close()
    server.stop()


def first_token_calls(world, request_id: str, prompt: list[int]):
    """(calls before the first token, calls after it, the result) of one request routed by
    the Conductor and prefilled with its plan."""
    engine, conductor, _, _, calls = world
    with calls.lock:
        calls.made.clear()
    decision = conductor.decide(RouteRequest(request_id, tuple(prompt)), ["p0"], ["d0"])
    params = SamplingParams(max_tokens=4, temperature=0)
    first, result = submit_prefill(engine, PrefillRequest(
        request_id, tuple(prompt), params, kv_transfer_params={"prefix_plan": decision.kv_plan}))
    first_at: list[float] = []
    first.add_done_callback(lambda _: first_at.append(time.monotonic()))
    out = result.result(timeout=60)
    time.sleep(0.2)  # the index events of this request, sent after its result
    return calls.before(first_at[0]), calls.after(first_at[0]), out, first.result()


def test_a_cold_request_waits_on_the_index_lookup_and_the_prefill_call_only(world, hf):
    prompt = hf.encode("Once upon a time, there was a little girl named Lily. " * 3)
    before, after, result, first = first_token_calls(world, "cold", prompt)
    assert before == ["index.longest_prefix"]  # the Conductor's; the worker asks nothing
    assert len(before) + ACTOR_CALLS <= 3
    # publishing did happen, after the first token: blocks, tail, G1 events
    assert {"node_store.put", "kv_store.put_tail", "index.apply_events"} <= set(after)
    assert first.token == result.first_token == hf.greedy(prompt, 1)[0]
    world[3].release_tail(handoff(result).tail_handle)


def test_a_planned_prefix_load_is_the_third_call(world, hf):
    """The prompt's prefix is in this node's G2 only (the worker's G1 was reset): the
    Conductor plans to load it, and the worker loads it from where the plan says, with no
    index lookup of its own."""
    engine, _, index, client, _ = world
    base = hf.encode("One day, a big dog named Max found a red ball in the park. " * 3)
    _, _, warm, _ = first_token_calls(world, "warm-0", base)
    client.release_tail(handoff(warm).tail_handle)
    assert engine.reset_prefix_cache()
    time.sleep(0.2)  # its index events, sent off the engine loop
    index.apply_events(Location(NODE, "host"), [BlockStored(handoff(warm).block_keys)])
    prompt = base + hf.encode(" Max was happy.", add_special_tokens=False)
    before, _, result, first = first_token_calls(world, "warm-1", prompt)
    assert before == ["index.longest_prefix", "node_store.get"]
    assert len(before) + ACTOR_CALLS <= 3
    assert result.num_cached_tokens == len(handoff(warm).block_keys) * 16 > 0
    assert first.token == hf.greedy(prompt, 1)[0]
    client.release_tail(handoff(result).tail_handle)
