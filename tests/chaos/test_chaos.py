"""Chaos suite: while 16 streaming requests run through the gateway,
kill -9 a prefill actor, a decode actor, redis-server and a node's KV store actor, in turn, and
stop a decode actor (SIGSTOP: hung, not dead).

For each kind the report counts requests completed, ended with a clear error (an HTTP error
status or an SSE error event) and lost (no final event within the deadline); lost must be 0.
Killed prefill and decode actors cost nothing visible: every request completes with exactly
the output it has without faults (computed first, in the same cluster), greedy and seeded,
and the killed actor rejoins once Ray restarts it; requests under a JSON schema (a quarter of
the seeded ones, and 50 of their own under a decode kill) end valid, their grammar carried
across the move. A request moved off a killed or hung decode ~300 tokens in loads what that
decode published to the pool (--kv-decode-publish-interval 4) and recomputes at most the 4
blocks since and the partial one. Redis restarting empty costs recompute,
never a request; the KV store re-announces its blocks. A killed KV store costs the requests
that needed it at that moment a clear error at most; Ray restarts it and the next requests all
complete. After each fault every live worker and KV store returns every block (no request
holds one, no tail is left behind).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import jsonschema
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from tests.chaos.conftest import (NUM_REQUESTS, PUBLISH_INTERVAL, SCHEMA, ChaosEnv, Report,
                                  RequestSpec, request_specs)

pytestmark = pytest.mark.slow


def kill9(pid: int):
    return lambda: os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def no_fault(chaos_env: ChaosEnv) -> Report:
    report = chaos_env.run("no fault")
    assert report.completed == NUM_REQUESTS and report.migrations == 0
    chaos_env.settle()
    return report


def assert_same_outputs(report: Report, no_fault: Report,
                        specs: list[RequestSpec] | None = None) -> None:
    """Each output equals the fault-free one; the structured ones are JSON valid under SCHEMA
    (a moved request resumed its grammar)."""
    for i, (got, want) in enumerate(zip(report.outcomes, no_fault.outcomes, strict=True)):
        assert len(want.token_ids) == want.chunks  # one token per chunk: ids are comparable
        assert (got.token_ids, got.text, got.finish_reason) == \
            (want.token_ids, want.text, want.finish_reason), f"request {i}"
    for spec in specs or request_specs():
        if spec.structured:
            jsonschema.validate(json.loads(report.outcomes[spec.index].text), SCHEMA)


@pytest.mark.parametrize("role, trigger_chunks", [("prefill", 1), ("decode", NUM_REQUESTS * 8)])
def test_killed_worker_costs_no_request_and_rejoins(chaos_env: ChaosEnv, no_fault: Report,
                                                     role: str, trigger_chunks: int):
    registry = chaos_env.cluster.registry
    if role == "prefill":
        # The bundled model prefills a short prompt in one step, so a running prefill may hold
        # nothing at any given chunk. Stopped before the load, the victim holds the requests
        # routed to it until the kill (sent once the other prefill's requests stream).
        victim_instance = registry.by_role(role)[0]
        victim = {"worker_id": victim_instance.worker_id,
                  "pid": chaos_env.pid_of(victim_instance)}
        os.kill(victim["pid"], signal.SIGSTOP)
        fault = kill9(victim["pid"])
    else:
        fault, victim = chaos_env.kill_busiest(role)
    deaths, rejoins = registry.deaths_total, registry.rejoins_total
    try:
        report = chaos_env.run(f"{role} actor killed", fault, trigger_chunks)
    except BaseException:
        if role == "prefill":  # the load failed before the kill: not left stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim["pid"], signal.SIGKILL)
        raise
    assert report.lost == 0
    assert report.completed == NUM_REQUESTS, str(report)
    assert report.migrations > 0 and registry.deaths_total > deaths  # the kill hit requests
    assert_same_outputs(report, no_fault)
    chaos_env.wait_rejoined(role, 2)
    [instance] = [i for i in getattr(chaos_env.cluster, role)
                  if i.worker_id == victim["worker_id"]]
    assert registry.rejoins_total > rejoins and chaos_env.pid_of(instance) != victim["pid"]
    chaos_env.settle()


def test_a_stopped_decode_is_declared_hung_and_costs_no_request(chaos_env: ChaosEnv,
                                                                no_fault: Report):
    """SIGSTOP: the process lives and answers nothing, which neither Ray nor the request path
    notices. The stall watch declares it hung after --worker-stall-timeout, Ray restarts it,
    and its requests migrate with the output they would have had."""
    watch = chaos_env.cluster.stall_watch
    hung = watch.hung_total
    fault, victim = chaos_env.kill_busiest("decode", signal.SIGSTOP)
    try:
        report = chaos_env.run("decode stopped (SIGSTOP)", fault, NUM_REQUESTS * 8)
    finally:
        if victim:
            try:
                os.kill(victim["pid"], signal.SIGCONT)  # were it not killed: let it go on
            except ProcessLookupError:
                pass
    assert report.lost == 0 and report.completed == NUM_REQUESTS, str(report)
    assert report.migrations > 0 and watch.hung_total == hung + 1
    assert_same_outputs(report, no_fault)
    health = httpx.get(f"{chaos_env.api_base.removesuffix('/v1')}/health", timeout=10).json()
    assert victim["worker_id"] in [h["worker_id"] for h in health["hung_workers"]], health
    chaos_env.wait_rejoined("decode", 2)
    [instance] = [i for i in chaos_env.cluster.decode if i.worker_id == victim["worker_id"]]
    assert chaos_env.pid_of(instance) != victim["pid"]
    chaos_env.settle()


BLOCK = 16
LONG_TOKENS = 420  # the prompts' ~15 tokens + this fit the bundled model's 512


def long_specs(salt: str) -> list[RequestSpec]:
    """Four long requests, two greedy and two seeded, under a cache salt of their own (the
    pool then holds only the KV this run published)."""
    subjects = ["a sleepy cat", "a brave mouse", "a tall giraffe", "a lost puppy"]
    return [RequestSpec(i, f"Once upon a time, there was {subjects[i]} who", i % 2 * 1.0,
                        3000 + i, max_tokens=LONG_TOKENS, cache_salt=salt) for i in range(4)]


def migration_tokens(env: ChaosEnv) -> dict[str, float]:
    text = httpx.get(f"{env.api_base.removesuffix('/v1')}/metrics", timeout=10).text
    return {s.labels["source"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "pdcluster_migration_tokens_total"}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_moved_request_loads_what_its_dead_decode_published(chaos_env: ChaosEnv, sig: int):
    """--kv-decode-publish-interval 4: a running request's full blocks reach the pool every
    4, so when its decode dies (or hangs) ~300 tokens in, its new worker loads prompt and
    output up to the last published block and recomputes only the rest: at most the 4
    blocks since plus the partial one. Outputs equal the fault-free run's."""
    pipeline = chaos_env.cluster.pipeline
    name = signal.Signals(sig).name
    reference = chaos_env.run("long, no fault", specs=long_specs(f"{name}-reference"))
    before = migration_tokens(chaos_env)
    assert reference.completed == 4 and reference.migrations == 0
    fault, victim = chaos_env.kill_busiest("decode", sig)
    seen = len(pipeline.migrations)
    try:  # ~300 tokens each (a chunk is a token)
        report = chaos_env.run(f"long, decode {name}", fault, 4 * 300, long_specs(name))
    finally:
        if sig == signal.SIGSTOP and victim:
            try:
                os.kill(victim["pid"], signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert report.lost == 0 and report.completed == 4, str(report)
    assert_same_outputs(report, reference, long_specs(name))
    moved = list(pipeline.migrations)[seen:]
    assert moved and len(moved) == report.migrations
    for migration in moved:
        assert migration.num_tokens > 200, migration  # moved mid-stream, not at its start
        assert migration.num_recomputed_tokens <= (PUBLISH_INTERVAL + 1) * BLOCK, migration
    after = migration_tokens(chaos_env)  # /metrics counts what the records say
    assert after["loaded"] - before["loaded"] == sum(m.num_cached_tokens for m in moved)
    assert after["recomputed"] - before["recomputed"] == \
        sum(m.num_recomputed_tokens for m in moved)
    chaos_env.wait_rejoined("decode", 2)
    chaos_env.settle()


def test_fifty_structured_outputs_stay_valid_through_a_decode_kill(chaos_env: ChaosEnv):
    """Seeded at temperature 1, each under SCHEMA; the decode running most of them is killed
    mid-request, and every one migrates with its grammar and ends valid."""
    specs = [RequestSpec(i, f"Once upon a time, a child had pet number {i}. It", 1.0, 2000 + i,
                         structured=True) for i in range(50)]
    fault, _ = chaos_env.kill_busiest("decode")
    report = chaos_env.run("decode killed under 50 JSON-schema requests", fault, 200, specs)
    assert report.lost == 0 and report.completed == 50, str(report)
    assert report.migrations > 0
    for outcome in report.outcomes:
        jsonschema.validate(json.loads(outcome.text), SCHEMA)
    chaos_env.wait_rejoined("decode", 2)
    chaos_env.settle()


def test_redis_restarting_empty_costs_recompute_never_errors(chaos_env: ChaosEnv,
                                                             no_fault: Report):
    [store] = chaos_env.cluster.registry.by_role("kvstore")
    before = chaos_env.settle()[store.worker_id]["index_reannouncements"]

    def crash_and_restart() -> None:
        chaos_env.redis.stop(kill=True)  # SIGKILL
        time.sleep(1.5)
        chaos_env.redis.start()  # same port, empty (no persistence)

    report = chaos_env.run("redis-server killed", crash_and_restart, 1)
    assert report.lost == 0 and report.completed == NUM_REQUESTS, str(report)
    assert_same_outputs(report, no_fault)
    deadline = time.monotonic() + 30
    while chaos_env.settle()[store.worker_id]["index_reannouncements"] <= before:
        assert time.monotonic() < deadline, "the KV store did not re-announce its blocks"
        time.sleep(0.2)


def test_killed_kv_store_restarts_and_serves_again(chaos_env: ChaosEnv, no_fault: Report):
    """Last: kill -9 the node's KV store. Requests that needed it end with a clear error or
    complete correctly (never lost); Ray restarts it empty at its address (kvstore/actor.py),
    the workers re-attach to its new arena, and then every request completes with the no-fault
    output. Nothing stays held."""
    [store] = chaos_env.cluster.registry.by_role("kvstore")
    pid = chaos_env.pid_of(store)
    report = chaos_env.run("KV store actor killed", kill9(pid), 1)
    assert report.lost == 0 and report.completed + report.errored == NUM_REQUESTS, str(report)
    for got, want in zip(report.outcomes, no_fault.outcomes):
        if got.completed:  # what completed is right; what failed streamed a correct prefix
            assert got.token_ids == want.token_ids
        else:
            assert want.token_ids[:len(got.token_ids)] == got.token_ids
    deadline = time.monotonic() + 60
    while True:
        try:
            if chaos_env.pid_of(store) != pid:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the KV store actor was not restarted"
        time.sleep(0.2)
    chaos_env.settle()
    after = chaos_env.run("after the KV store restarted")
    assert after.completed == NUM_REQUESTS and after.lost == 0, str(after)
    assert_same_outputs(after, no_fault)
    chaos_env.settle()
