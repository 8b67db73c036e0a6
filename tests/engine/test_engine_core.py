"""The one engine core, driven step by step on this thread, without Ray or a KV store; the
reference is the same request run alone on a fresh engine.

On a decode instance every request whose KV is behind (a colocated prompt, a prompt whose
fetch failed, a request resumed after preemption by recompute) is computed in chunks under the
step's token budget, in the same forwards as the running decodes. On a prefill instance the
same engine ends each request after its first token and hands its blocks to the connector
that saves them."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch

from pdcluster.decode_worker.instance import decode_core
from pdcluster.engine.core.engine_core import EngineCore
from pdcluster.engine.config import BUNDLED_MODEL, EngineConfig
from pdcluster.engine.core.engine_loop import run_once
from pdcluster.engine.core.kv_connector import KVConnector, KVConnectorRequest, LoadOutcome
from pdcluster.engine.core.request import RequestStatus
from pdcluster.engine.core.scheduler import chunk_end
from pdcluster.engine.protocol import (DecodeRequest, FinishReason, PrefillRequest, PrefillResult,
                                       SamplingParams, StructuredOutputSpec)
from pdcluster.engine.runner import ModelRunner
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.kvstore.config import KVTransferConfig
from pdcluster.kvstore.transport.fetch import FetchConnector
from pdcluster.prefill_worker.instance import prefill_core, submit_prefill
from tests.engines import fetch_of, submit_decode

BUDGET = 32
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
         "the park with her friends. One day, she saw a big red ball")


class HeldFetches(FetchConnector):
    """A decode's connector whose fetches settle only when the test says so: landed (the KV is
    written from a reference engine's cache, as a real fetch writes it) or failed."""

    def __init__(self) -> None:
        super().__init__(KVTransferConfig())
        self.pending: dict[str, tuple[KVConnectorRequest, list[int], int]] = {}
        self.settled: dict[str, LoadOutcome] = {}

    def update_state_after_alloc(self, request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        self.pending[request.request_id] = (request, list(block_ids), num_external_tokens)

    def start_load_kv(self) -> None:
        pass

    def fail(self, request_id: str) -> None:
        del self.pending[request_id]
        self.settled[request_id] = LoadOutcome(failures=["held fetch failed"],
                                               detail={"paths": ["held"]})

    def get_finished(self):
        settled, self.settled = self.settled, {}
        return {}, settled

    def request_finished(self, request, block_ids):
        return False, {}


class Recorded:
    """The runner's forwards, as (new tokens, first position) per chunk of each step."""

    def __init__(self, runner: ModelRunner) -> None:
        self.steps: list[list[tuple[int, int]]] = []
        self._execute = runner.execute
        runner.execute = self

    def __call__(self, chunks, **kwargs):
        self.steps.append([(len(c.token_ids), c.num_computed_tokens) for c in chunks])
        return self._execute(chunks, **kwargs)


def engine(num_kv_blocks: int = 64, mode: str = "recompute",
           policy: str = "fcfs") -> EngineCore:
    config = EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=num_kv_blocks,
                          max_num_batched_tokens=BUDGET, preemption_mode=mode,
                          scheduling_policy=policy)
    return decode_core(ModelRunner(config), "decode-t", 0, HeldFetches())


def submit(eng: EngineCore, request: DecodeRequest) -> list:
    deltas: list = []
    submit_decode(eng, request, deltas.append)
    return deltas


def tokens(deltas: list) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def run(eng: EngineCore, *outputs: list, limit: int = 500) -> None:
    """Step until every one of ``outputs`` has its last delta."""
    for _ in range(limit):
        if all(o and o[-1].finish_reason is not None for o in outputs):
            return
        if not run_once(eng):
            time.sleep(0.002)  # nothing to run: a grammar compiling off the loop, say
    raise AssertionError("requests did not finish")


def test_one_budget_counts_decode_rows_and_max_num_seqs_bounds_the_batch(prompt):
    """vLLM v1's budget on a colocated load that mixes decoding requests and arriving
    prompts: no step runs more than max_num_batched_tokens tokens, decode rows included, the
    steps where both run fill it, at most max_num_seqs requests share a step, and each
    request's greedy output is the one it has alone."""
    config = EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=128, max_num_seqs=3,
                          max_num_batched_tokens=BUDGET, enable_prefix_caching=False)
    eng = decode_core(ModelRunner(config), "decode-t", 0, HeldFetches())
    recorded = Recorded(eng.runner)
    params = SamplingParams(max_tokens=10, temperature=0)
    prompts = [prompt[:n] for n in (20, 29, 37, 26, 45)]
    outs = []
    for i, p in enumerate(prompts):  # each arrives while the ones before it decode
        outs.append(submit(eng, DecodeRequest(f"r{i}", p, params)))
        for _ in range(3):
            run_once(eng)
    run(eng, *outs)
    eng.close()
    sizes = [sum(n for n, _ in step) for step in recorded.steps]
    assert max(sizes) == BUDGET, sizes
    mixed = [step for step in recorded.steps if any(n == 1 for n, _ in step)
             and any(n > 1 for n, _ in step)]
    assert mixed and all(sum(n for n, _ in step) <= BUDGET for step in mixed)
    assert max(len(step) for step in recorded.steps) == 3
    for p, out in zip(prompts, outs):
        assert tokens(out) == alone(p, params)


@pytest.fixture(scope="module")
def prompt() -> tuple[int, ...]:
    return tuple(Tokenizer.from_pretrained(BUNDLED_MODEL).encode(STORY))


def alone(prompt: tuple[int, ...], params: SamplingParams) -> list[int]:
    eng = engine()
    out = submit(eng, DecodeRequest("alone", prompt, params))
    run(eng, out)
    eng.close()
    return tokens(out)


def from_prefill(request_id: str, prompt: tuple[int, ...], params: SamplingParams,
                 first_token: int) -> DecodeRequest:
    """A request whose prompt a prefill computed: its first token and a hand-off to fetch."""
    result = PrefillResult(request_id, first_token, 0, "prefill-t", 0,
                           kv_transfer_params={"kv_address": "held"})
    return DecodeRequest(request_id, prompt, params, result)


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)


def test_one_step_holds_decodes_and_a_colocated_chunk_while_a_request_waits_for_kv(prompt):
    eng = engine()
    recorded = Recorded(eng.runner)
    first = submit(eng, DecodeRequest("decoding", prompt[5:25], GREEDY))  # shares no block
    for _ in range(3):
        run_once(eng)  # its prompt (one chunk), then decode steps
    assert eng.scheduler.active["decoding"].output_ids
    want_first = alone(prompt, GREEDY)[0]
    remote = submit(eng, from_prefill("remote", prompt, GREEDY, want_first))
    local = submit(eng, DecodeRequest("local", prompt, GREEDY))
    recorded.steps.clear()
    run_once(eng)
    assert eng.scheduler.active["remote"].status is RequestStatus.WAITING_FOR_KV
    # the decoding request's one token and the colocated prompt's first chunk, in one forward
    # of the budget
    [step] = recorded.steps
    assert step[0][0] == 1 and step[1] == (BUDGET - 1, 0)
    fetch_of(eng).fail("remote")  # its KV never comes: it is computed here after all
    run(eng, first, remote, local)
    assert tokens(local) == alone(prompt, GREEDY)
    assert [want_first, *tokens(remote)] == alone(prompt, GREEDY)
    eng.close()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_failed_load_is_rescheduled_from_its_last_good_block(prompt, params):
    eng = engine()
    recorded = Recorded(eng.runner)
    cached = (len(prompt) // 2) // 16 * 16
    warm = submit(eng, DecodeRequest("warm", prompt[:cached + 1], GREEDY))
    run(eng, warm)  # its full blocks stay in the decode's prefix cache
    steady_params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    steady = submit(eng, DecodeRequest("steady", prompt[5:13], steady_params))
    run_once(eng)
    want = alone(prompt, params)
    out = submit(eng, from_prefill("failed", prompt, params, want[0]))
    run_once(eng)
    held = eng.scheduler.active["failed"]
    assert held.num_cached_tokens == cached > 0 and held.status is RequestStatus.WAITING_FOR_KV
    fetch_of(eng).fail("failed")
    recorded.steps.clear()
    run(eng, out, steady)
    # the prompt after the cached blocks, in chunks of the budget, each in a forward with the
    # steady request's decode; then decode steps
    chunks = [(c, step) for step in recorded.steps for c in step if c[0] > 1]
    assert chunks[0][0][1] == cached
    assert sum(n for (n, _), _ in chunks) == len(prompt) - cached
    assert all(n <= BUDGET and any(m == 1 for m, _ in step)
               for (n, _), step in chunks)
    assert [want[0], *tokens(out)] == want
    assert tokens(steady) == alone(prompt[5:13], steady_params)
    stats = eng.stats()
    assert stats.num_fetch_recomputes_total == 1
    assert stats.num_recomputed_tokens_total == len(prompt) - cached
    assert out[-1].finish_reason is FinishReason.LENGTH
    eng.close()


@pytest.mark.parametrize("temperature, grammar", [
    (0, None), (0.8, None), (0.8, StructuredOutputSpec("regex", "[a-z ,.]{20,60}"))],
    ids=["greedy", "seeded", "structured"])
def test_a_preempted_request_resumes_in_chunks_beside_the_running_batch(prompt, temperature,
                                                                        grammar):
    """Two short requests decode; a long one joins; the short ones' growth preempts it (the
    newest), and once one of them ends it resumes: its tokens are recomputed in chunks of
    the budget, in the same steps as the other's decodes (a grammar's state goes on with
    it)."""
    eng = engine(num_kv_blocks=-(-(len(prompt) + 1) // 16) + 5)
    recorded = Recorded(eng.runner)
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=5, ignore_eos=True,
                            structured_output=grammar)
    steady_params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    grower_params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    steady = submit(eng, DecodeRequest("steady", prompt[:8], steady_params))
    grower = submit(eng, DecodeRequest("grower", prompt[1:9], grower_params))
    for _ in range(12):
        run_once(eng)
    long_ = submit(eng, DecodeRequest("long", prompt, params))
    preempted, catch_up = False, []
    while not (steady[-1:] and steady[-1].finish_reason and long_[-1:]
               and long_[-1].finish_reason):
        request = eng.scheduler.find_waiting("long") or eng.scheduler.active.get("long")
        preempted |= request is not None and request.status is RequestStatus.PREEMPTED
        behind = (preempted and request is not None and request.status is RequestStatus.RUNNING
                  and request.num_computed_tokens < chunk_end(request))
        run_once(eng)
        if behind:
            catch_up.append(recorded.steps[-1])
    assert eng.stats().num_preemptions_total > 0 and catch_up
    # the recompute ran in chunks of at most the budget, sharing forwards with the decodes
    assert all(n <= BUDGET for step in catch_up for n, _ in step)
    assert any(any(n > 1 for n, _ in step) and any(n == 1 for n, _ in step)
               for step in catch_up)
    assert tokens(long_) == alone(prompt, params)
    assert tokens(steady) == alone(prompt[:8], steady_params)
    assert tokens(grower) == alone(prompt[1:9], grower_params)
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    eng.close()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_scheduling_policy_picks_who_is_preempted(prompt, policy):
    """A lax request (priority 1) decodes; an urgent one (priority 0) joins; their growth
    needs a preemption. fcfs preempts the newest (urgent), priority the least urgent (lax,
    though older), as vLLM's policies do; both outputs stay those of a run alone."""
    eng = engine(num_kv_blocks=-(-(len(prompt) + 1) // 16) + 5, policy=policy)
    lax_params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, priority=1)
    urgent_params = SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)
    lax = submit(eng, DecodeRequest("lax", prompt[:8], lax_params))
    for _ in range(12):
        run_once(eng)
    urgent = submit(eng, DecodeRequest("urgent", prompt, urgent_params))
    preempted: set[str] = set()
    for _ in range(1000):
        if lax[-1:] and lax[-1].finish_reason and urgent[-1:] and urgent[-1].finish_reason:
            break
        preempted |= {r.request_id for r in eng.scheduler.waiting
                      if r.status is RequestStatus.PREEMPTED}
        run_once(eng)
    assert preempted == ({"urgent"} if policy == "fcfs" else {"lax"})
    assert tokens(urgent) == alone(prompt, urgent_params)
    assert tokens(lax) == alone(prompt[:8], lax_params)
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    eng.close()


class SavedBlocks(KVConnector):
    """A prefill's saving connector: copies each finished prompt's full blocks and gives
    their count back as the request's KV transfer params once the loop asks again."""

    def __init__(self) -> None:
        self.saved: dict[str, object] = {}
        self._settled: dict[str, dict] = {}

    def request_finished(self, request, block_ids):
        if block_ids:
            self.saved[request.request_id] = self.cache.read_blocks(
                block_ids[:len(request.block_keys)]).clone()
            self._settled[request.request_id] = {"num_saved": len(request.block_keys)}
        return False, None  # the params come from get_finished

    def get_finished(self):
        settled, self._settled = self._settled, {}
        return settled, {}


def test_a_prefill_instance_ends_each_request_at_its_first_token_and_saves_its_blocks(prompt):
    """The prefill role of the same engine: token 0 equals a colocated request's, the
    connector gets the prompt's full blocks once they are computed, the result carries its
    params, and every block is back in the pool (cached)."""
    config = EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=64,
                          max_num_batched_tokens=BUDGET)
    saver = SavedBlocks()
    eng = prefill_core(ModelRunner(config), saver, "prefill-t", 0)
    recorded = Recorded(eng.runner)
    first, result = submit_prefill(eng, PrefillRequest("p", prompt, GREEDY))
    for _ in range(50):
        if result.done():
            break
        run_once(eng)
    eng._events.submit(lambda: None).result(timeout=10)  # the events thread delivered
    got = result.result(timeout=10)
    assert first.result().token == got.first_token == alone(prompt, GREEDY)[0]
    assert got.kv_transfer_params == {"num_saved": len(prompt) // 16}
    assert saver.saved["p"].shape[0] == len(prompt) // 16
    # the prompt in chunks of the budget, nothing else
    assert [n for step in recorded.steps for n, _ in step] == \
        [min(BUDGET, len(prompt) - s) for s in range(0, len(prompt), BUDGET)]
    stats = eng.stats()
    assert stats.num_requests_total == 1 and stats.num_steps_total == 0
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    eng.close()


def test_prompt_logprobs_span_the_chunks_of_a_prompt_and_skip_the_prefix_cache(prompt, hf):
    eng = engine()
    assert len(prompt) > BUDGET  # two chunks
    run(eng, submit(eng, DecodeRequest("warm", prompt, GREEDY)))  # the prompt is cached now
    scored = submit(eng, DecodeRequest("scored", prompt, SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=2)))
    run(eng, scored)
    entries = scored[0].prompt_logprobs
    assert scored[0].num_cached_tokens == 0 and len(entries) == len(prompt) - 1
    logprobs = torch.log_softmax(hf.logits(list(prompt)), dim=-1)
    for i, e in enumerate(entries):
        assert e.token_id == prompt[i + 1]
        assert abs(e.logprob - float(logprobs[i, e.token_id])) < 1e-4
        assert [t for t, _ in e.top] == torch.topk(logprobs[i], 2).indices.tolist()
    eng.close()


def test_stats_report_the_prompt_tokens_still_to_compute(prompt):
    """What every gateway's Conductor reads as the worker's prefill queue: prompt tokens of
    waiting and running requests not yet in the cache, falling chunk by chunk to 0."""
    eng = engine()
    assert len(prompt) > BUDGET
    outs = [submit(eng, DecodeRequest(f"r{i}", prompt, GREEDY)) for i in range(2)]
    run_once(eng)  # takes them in, and computes one budget of their prompts
    seen = [eng.stats().num_pending_prompt_tokens]
    assert seen[0] == 2 * len(prompt) - BUDGET
    while any(not o for o in outs):
        run_once(eng)
        seen.append(eng.stats().num_pending_prompt_tokens)
    assert seen[-1] == 0 and all(a >= b for a, b in zip(seen, seen[1:]))
    assert len(set(seen)) > 2  # it fell in chunks, not at once
    run(eng, *outs)
    eng.close()
