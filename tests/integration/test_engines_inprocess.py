"""Prefill engine → gRPC KV store → decode engine in one process (no Ray): stop conditions,
prefix reuse and block accounting, against transformers' generate as the reference."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch

from pdcluster.decode_worker.instance import decode_core
from pdcluster.engine.core.engine_core import EngineCore
from tests.engines import submit_decode
from pdcluster.engine.config import BUNDLED_MODEL, EngineConfig
from pdcluster.engine.core.engine_loop import EngineLoop, run_once
from pdcluster.engine.protocol import DecodeRequest, FinishReason, PrefillRequest, SamplingParams
from pdcluster.engine.runner import ModelRunner
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transport.fetch import FetchConnector
from pdcluster.kvstore.transport.pool.connector import PoolConnector
from pdcluster.prefill_worker.instance import prefill as run_prefill, prefill_core, submit_prefill
from tests.kvstore.lru_block_store import lru_server
from tests.engine_loops import started, stop
from tests.handoffs import handoff
from tests.markers import starts

GRPC_5S = KVTransferConfig(timeout_s=5)


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory):
    """The bundled model, with BOS (1) also declared an EOS id: llama2.c ends each story with
    BOS, so this copy really stops; the weights are untouched."""
    path = tmp_path_factory.mktemp("model") / "stories260K-eos"
    shutil.copytree(BUNDLED_MODEL, path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [1, 2]}))
    return path


@pytest.fixture(scope="module")
@starts("server")
def engines(eos_model_dir):
    server = lru_server(KVStoreConfig())
    server.start()
    config = EngineConfig(model=str(eos_model_dir), num_kv_blocks=128)
    client = KVStoreClient(server.address)
    prefill = started(lambda: prefill_core(ModelRunner(config), grpc_kv(client, server.address),
                                            "prefill-0", 0))
    decode_runner = ModelRunner(config)
    decode = started(lambda: decode_core(decode_runner, "decode-0", 0,
                                          FetchConnector(GRPC_5S)))
    yield prefill, decode
    stop(decode)
    stop(prefill)
    client.close()
    server.stop()


def grpc_kv(client: KVStoreClient, address: str) -> PoolConnector:
    """A store in this process, reached over gRPC (no Ray, no arena, no cluster index)."""
    return PoolConnector("local-node", client, address, client)


def decode_all(decode: EngineCore, request: DecodeRequest) -> list:
    """Every TokenDelta of `request` on the decode engine, once it finished."""
    deltas, done = [], threading.Event()

    def emit(delta):
        deltas.append(delta)
        if delta.finish_reason is not None:
            done.set()

    submit_decode(decode, request, emit)
    assert done.wait(60)
    return deltas


def generate(engines, request_id: str, prompt: list[int], params: SamplingParams):
    prefill, decode = engines
    result = run_prefill(prefill, PrefillRequest(request_id, tuple(prompt), params))
    deltas = decode_all(decode, DecodeRequest(request_id, tuple(prompt), params, result))
    return result, [result.first_token] + [t for d in deltas for t in d.token_ids], deltas[-1]


def test_eos_stops_and_ignore_eos_continues(engines, hf):
    prompt = hf.encode("Once upon a time")
    want = hf.greedy(prompt, 400, eos_token_id=[1, 2])
    assert want[-1] == 1, "reference did not stop at the story delimiter"
    _, got, last = generate(engines, "eos", prompt, SamplingParams(max_tokens=400,
                                                                   temperature=0))
    assert got == want and last.finish_reason is FinishReason.STOP
    _, got, last = generate(engines, "ignore-eos", prompt,
                            SamplingParams(max_tokens=len(want) + 10, temperature=0,
                                           ignore_eos=True))
    assert got[:len(want)] == want and len(got) == len(want) + 10
    assert last.finish_reason is FinishReason.LENGTH
    # min_tokens past the EOS position: the EOS ids are masked until then
    _, got, _ = generate(engines, "min-tokens", prompt,
                         SamplingParams(max_tokens=len(want) + 3, temperature=0,
                                        min_tokens=len(want) + 1))
    assert got[:len(want) - 1] == want[:-1] and got[len(want) - 1] not in (1, 2)


def test_prefix_reuse_skips_cached_blocks_and_output_is_unchanged(engines, hf):
    prefill, decode = engines
    story = hf.encode("Once upon a time, there was a little girl named Lily. She loved to play "
                      "outside in the park with her friends every day.")
    assert len(story) > 33
    want = hf.greedy(story, 16, eos_token_id=[1, 2])
    params = SamplingParams(max_tokens=16, temperature=0)
    first, got, _ = generate(engines, "cold", story, params)
    assert got == want and first.num_cached_tokens == 0
    again, got, _ = generate(engines, "warm", story, params)
    full_blocks = (len(story) - 1) // 16
    assert again.num_cached_tokens == full_blocks * 16 and got == want
    longer = story + hf.encode(" One day", add_special_tokens=False)
    branch, got, _ = generate(engines, "branch", longer, params)
    assert branch.num_cached_tokens == (len(story) // 16) * 16
    assert got == hf.greedy(longer, 16, eos_token_id=[1, 2])
    stats = prefill.stats()
    assert stats.num_used_blocks == 0 and stats.num_cached_blocks > 0
    assert decode.stats().num_free_blocks == decode.stats().num_blocks


def test_cache_salt_isolates_tenants(engines, hf):
    prefill, _ = engines
    prompt = hf.encode("Ben had a red car. He drove it to the shop to buy milk and bread.")
    params = SamplingParams(max_tokens=2, temperature=0)
    a = run_prefill(prefill, PrefillRequest("salt-a1", tuple(prompt), params, cache_salt="tenant-a"))
    b = run_prefill(prefill, PrefillRequest("salt-b", tuple(prompt), params, cache_salt="tenant-b"))
    a2 = run_prefill(prefill, PrefillRequest("salt-a2", tuple(prompt), params, cache_salt="tenant-a"))
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0 and a2.num_cached_tokens > 0
    assert set(handoff(a).block_keys).isdisjoint(handoff(b).block_keys)
    for r in (a, b, a2):
        prefill.connector.store_client.release_tail(handoff(r).tail_handle)


def test_prefix_caching_switch_off_recomputes(engines, eos_model_dir, hf):
    prefill, _ = engines
    config = EngineConfig(model=str(eos_model_dir), num_kv_blocks=64,
                          enable_prefix_caching=False)
    off = started(lambda: prefill_core(ModelRunner(config),
                                        grpc_kv(prefill.connector.store_client, prefill.connector.store_address), "off", 0))
    prompt = hf.encode("Once upon a time, there was a girl who liked to read books about cats.")
    params = SamplingParams(max_tokens=2, temperature=0)
    results = [run_prefill(off, PrefillRequest(f"off-{i}", tuple(prompt), params)) for i in range(2)]
    assert [r.num_cached_tokens for r in results] == [0, 0]
    assert off.stats().num_prefill_tokens_total == 2 * len(prompt)
    assert results[0].first_token == results[1].first_token == hf.greedy(prompt, 1)[0]
    for r in results:
        off.connector.store_client.release_tail(handoff(r).tail_handle)


def test_chunked_prefill_equals_unchunked(engines, eos_model_dir, hf):
    prefill, _ = engines
    prompt = (hf.encode("Once upon a time, there was a big dog named Max.") +
              hf.encode(" Max liked to run in the park with his friends." * 30,
                        add_special_tokens=False))[:400]
    assert len(prompt) == 400
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=3)
    chunked_config = EngineConfig(model=str(eos_model_dir), num_kv_blocks=64,
                                  max_num_batched_tokens=64, enable_prefix_caching=False)
    chunked = started(lambda: prefill_core(ModelRunner(chunked_config),
                                            grpc_kv(prefill.connector.store_client, prefill.connector.store_address),
                                            "chunked", 0))
    whole_config = chunked_config.model_copy(update={"max_num_batched_tokens": 512})
    whole = started(lambda: prefill_core(ModelRunner(whole_config),
                                          grpc_kv(prefill.connector.store_client, prefill.connector.store_address),
                                          "whole", 0))
    a = run_prefill(chunked, PrefillRequest("chunked", tuple(prompt), params))
    b = run_prefill(whole, PrefillRequest("whole", tuple(prompt), params))
    assert a.first_token == b.first_token == hf.greedy(prompt, 1)[0]
    assert a.first_logprob.logprob == pytest.approx(b.first_logprob.logprob, abs=1e-5)
    assert [t for t, _ in a.first_logprob.top] == [t for t, _ in b.first_logprob.top]
    # and the KV the chunks wrote is the KV decode continues from
    decode_runner = ModelRunner(whole_config)
    decode = started(lambda: decode_core(decode_runner, "d-chunk", 0,
                                          FetchConnector(GRPC_5S)))
    try:
        _, got, _ = generate((chunked, decode), "chunked-2", prompt,
                             SamplingParams(max_tokens=12, temperature=0))
    finally:
        stop(decode)
    assert got == hf.greedy(prompt, 12, eos_token_id=[1, 2])
    for r in (a, b):
        prefill.connector.store_client.release_tail(handoff(r).tail_handle)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(engines, eos_model_dir, hf, mode):
    """4 requests of ~90 tokens in a 12-block (192-token) decode cache: growing requests
    preempt the newest; every output equals the request run alone (greedy and seeded)."""
    prefill, _ = engines
    config = EngineConfig(model=str(eos_model_dir), num_kv_blocks=12, preemption_mode=mode,
                          max_num_batched_tokens=32)
    runner = ModelRunner(config)
    small = started(lambda: decode_core(runner, f"small-{mode}", 0,
                                         FetchConnector(GRPC_5S)))
    texts = ["Once upon a time", "The big dog", "Lily had a cat", "Tom went to the park"]
    prompts = [hf.encode(t + ", and they played all day long in the sun.") for t in texts]
    params = [SamplingParams(max_tokens=70, temperature=0 if i % 2 else 0.9, seed=7 + i,
                             ignore_eos=True) for i in range(4)]
    try:
        alone = [generate((prefill, small), f"{mode}-alone-{i}", p, params[i])[1]
                 for i, p in enumerate(prompts)]
        assert small.stats().num_preemptions_total == 0
        done, outputs = threading.Event(), {}

        def collect(i):
            def emit(delta):
                outputs.setdefault(i, []).extend(delta.token_ids)
                if delta.finish_reason is not None:
                    outputs[f"done-{i}"] = delta.finish_reason
                    if sum(k.startswith("done") for k in map(str, outputs)) == 4:
                        done.set()
            return emit

        for i, p in enumerate(prompts):
            result = run_prefill(prefill, PrefillRequest(f"{mode}-busy-{i}", tuple(p), params[i]))
            outputs[i] = [result.first_token]
            submit_decode(small, DecodeRequest(f"{mode}-busy-{i}", tuple(p), params[i], result),
                              collect(i))
        assert done.wait(120)
        stats = small.stats()
    finally:
        stop(small)
    assert stats.num_preemptions_total > 0
    for i in range(4):
        assert outputs[f"done-{i}"] is FinishReason.LENGTH
        assert outputs[i] == alone[i], f"request {i} changed under {mode} preemption"
    assert stats.num_free_blocks == stats.num_blocks


def test_colocated_request_prefills_on_the_decode_worker(engines, hf):
    _, decode = engines
    prompt = hf.encode("Once upon a time, there was a little boy named Tim.")
    want = hf.greedy(prompt, 20, eos_token_id=[1, 2])
    forward_before = decode.stats().num_forward_tokens_total
    deltas = decode_all(decode, DecodeRequest("colocated", tuple(prompt),
                                              SamplingParams(max_tokens=20, temperature=0)))
    assert [t for d in deltas for t in d.token_ids] == want
    assert deltas[0].token_ids == (want[0],)  # token 0 sampled here, from the local prefill
    assert decode.stats().num_forward_tokens_total - forward_before == len(want) - 1
    assert decode.stats().num_free_blocks == decode.stats().num_blocks


def test_colocated_prompts_run_in_chunks_beside_decoding_requests(eos_model_dir, hf):
    """Colocated, a prompt runs in chunks of max_num_batched_tokens that share the forwards of
    the requests already decoding: the decoding request gains one token in every step of the
    other's prompt, and both outputs equal transformers' greedy ones. The test drives the
    engine's loop body itself, so the steps are counted exactly."""
    config = EngineConfig(model=str(eos_model_dir), num_kv_blocks=64, max_num_batched_tokens=32)
    runner = ModelRunner(config)
    engine = decode_core(runner, "colocated-chunks", 0,
                          FetchConnector(GRPC_5S))
    short = hf.encode("Once upon a time, there was a little boy named Tim.")
    long = (hf.encode("One day, a big dog named Max found a red ball.") +
            hf.encode(" Lily liked to play with her doll in the garden." * 20,
                      add_special_tokens=False))[:150]
    params = SamplingParams(max_tokens=30, temperature=0)
    tokens: dict[str, list[int]] = {"short": [], "long": []}
    finished: set[str] = set()

    def emit_to(name):
        def emit(delta):
            tokens[name].extend(delta.token_ids)
            if delta.finish_reason is not None:
                finished.add(name)
        return emit

    def run_until(done) -> None:
        deadline = time.monotonic() + 60
        while not done():
            assert time.monotonic() < deadline
            run_once(engine)

    submit_decode(engine, DecodeRequest("short", tuple(short), params), emit_to("short"))
    run_until(lambda: len(tokens["short"]) >= 3)
    submit_decode(engine, DecodeRequest("long", tuple(long), params), emit_to("long"))
    before = len(tokens["short"])
    run_until(lambda: tokens["long"])
    assert len(tokens["short"]) - before == -(-150 // 32)  # one decode token per prompt chunk
    run_until(lambda: len(finished) == 2)
    stats = engine.stats()
    engine.close()
    for name, prompt in (("short", short), ("long", long)):
        want = hf.greedy(prompt, 30, eos_token_id=[1, 2])
        assert len(want) == 30, "reference stopped early"
        assert tokens[name] == want
    assert stats.num_free_blocks == stats.num_blocks


def test_engine_loop_builds_the_model_and_runs_every_step_on_its_thread(eos_model_dir, hf):
    """The worker actors' engine loop: the engine (model included) is built on the loop's
    thread and every forward runs there (engine/core/engine_loop.py: the first OpenMP thread
    runs fastest); a failed build is raised to the caller."""
    built_on, forward_threads = {}, set()

    def build():
        built_on["thread"] = threading.get_ident()
        runner = ModelRunner(EngineConfig(model=str(eos_model_dir), num_kv_blocks=32))
        runner.model.register_forward_hook(lambda *_: forward_threads.add(threading.get_ident()))
        return decode_core(runner, "own-thread", 0,
                            FetchConnector(GRPC_5S))

    loop = EngineLoop(build, "decode-engine", timeout_s=60)
    try:
        prompt = hf.encode("Once upon a time")
        deltas = decode_all(loop.core, DecodeRequest("own", tuple(prompt),
                                                     SamplingParams(max_tokens=5, temperature=0)))
        assert [t for d in deltas for t in d.token_ids] == hf.greedy(prompt, 5,
                                                                      eos_token_id=[1, 2])
        assert loop.thread.ident == built_on["thread"] != threading.get_ident()
        assert forward_threads == {built_on["thread"]}
    finally:
        loop.shutdown()
    assert not loop.thread.is_alive()
    with pytest.raises(ValueError, match="no such model"):
        EngineLoop(lambda: (_ for _ in ()).throw(ValueError("no such model")), "bad")


@pytest.mark.parametrize("compute_bound_tokens", [512, 100])
def test_concurrent_prefills_share_steps_and_outputs_are_unchanged(engines, eos_model_dir, hf,
                                                                   compute_bound_tokens):
    """Chunks of several requests run in one forward step under the token budget, until the
    step holds compute_bound_tokens; each request's first token, logprob and KV equal the
    request run alone. The test drives the engine's loop body itself, so every request is
    queued before the first step."""
    prefill, _ = engines
    config = EngineConfig(model=str(eos_model_dir), num_kv_blocks=128,
                          max_num_batched_tokens=512, enable_prefix_caching=False,
                          prefill_compute_bound_tokens=compute_bound_tokens)
    shared = prefill_core(ModelRunner(config), grpc_kv(prefill.connector.store_client, prefill.connector.store_address),
                           "batched", 0)
    alone = started(lambda: prefill_core(ModelRunner(config),
                                          grpc_kv(prefill.connector.store_client, prefill.connector.store_address),
                                          "alone", 0))
    stories = ["a big dog named Max", "a little cat named Sue", "a red ball in the park",
               "a girl who liked to sing", "a tall tree by the river", "a boy and his kite"]
    prompts = [(hf.encode(f"Once upon a time, there was {s}.") +
                hf.encode(f" Every day {s} was happy." * 12, add_special_tokens=False))
               [:100 + 37 * i] for i, s in enumerate(stories)]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=2)
    futures = [submit_prefill(shared, PrefillRequest(f"b{i}", tuple(p), params))[1]
               for i, p in enumerate(prompts)]
    deadline = time.monotonic() + 60
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, "prefills never finished"
        if not run_once(shared):
            time.sleep(0.01)  # publishing, off the loop
    results = {i: f.result() for i, f in enumerate(futures)}
    stats = shared.stats()
    if compute_bound_tokens == 512:
        # 1,155 prompt tokens (100..285 each) under a 512-token budget: every step but the
        # last is filled, by several requests' chunks (a chunk is cut to what is left)
        total = sum(len(p) for p in prompts)
        assert stats.num_prefill_tokens_total == total
        assert stats.num_prefill_steps_total == -(-total // 512)
        assert stats.max_prefill_chunks_per_step >= 2
    else:  # each prompt is compute-bound on its own: a step each, in one chunk
        assert stats.num_prefill_chunks_total == len(prompts)
        assert stats.max_prefill_chunks_per_step == 1
        assert stats.num_prefill_steps_total == stats.num_prefill_chunks_total
    assert stats.num_used_blocks == 0
    shared.close()
    for i, prompt in enumerate(prompts):
        want = run_prefill(alone, PrefillRequest(f"a{i}", tuple(prompt), params))
        got = results[i]
        assert got.first_token == want.first_token == hf.greedy(prompt, 1)[0]
        assert got.first_logprob.logprob == pytest.approx(want.first_logprob.logprob, abs=1e-5)
        # the last (partial) block's KV depends on every earlier token through every layer
        (kv_got, n_got), (kv_want, n_want) = (prefill.connector.store_client.take_tail(handoff(r).tail_handle)
                                              for r in (got, want))
        assert n_got == n_want == len(prompt) % 16
        # (the blocks' bytes, read as the float32 the bundled model's one-dtype spec holds)
        assert (kv_got.view(torch.float32) - kv_want.view(torch.float32)).abs().max() < 1e-4
    stop(alone)
