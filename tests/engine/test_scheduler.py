"""engine.core: the KV cache manager and the scheduler, driven without Ray or a model."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from pdcluster.engine.core.kv_cache_manager import KVCacheManager
from pdcluster.engine.core.preemption import PREEMPTION_MODES, RecomputePreemption, SwapPreemption
from pdcluster.engine.core.request import RequestStatus
from pdcluster.engine.core.scheduler import Scheduler
from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.blocks import num_blocks_for, num_full_blocks
from pdcluster.engine.core.hashing import block_keys, make_namespace

BLOCK = 4


@dataclass(eq=False)
class Req:
    """A request as the scheduler sees it: prompt_len tokens of prompt, `out` output tokens."""

    request_id: str
    prompt_len: int
    out: int = 1
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    arrival: int = 0
    swapped: torch.Tensor | None = None
    block_keys: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    runs_alone: bool = False
    priority: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_len

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.out



class HostCache:
    """A block copier over a tensor of blocks (what ModelRunner.wire_kv is, without a model)."""

    device = torch.device("cpu")

    def __init__(self, num_blocks: int) -> None:
        self.blocks = torch.zeros(num_blocks, 2)

    def read_blocks(self, ids):
        return self.blocks[list(ids)].clone()

    def write_blocks(self, ids, data):
        self.blocks[list(ids)] = data


def make(num_blocks: int, mode: str = "recompute", policy: str = "fcfs"):
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=True), BLOCK)
    cache = HostCache(num_blocks)
    return Scheduler(kv, PREEMPTION_MODES[mode](kv, cache), policy=policy), cache


def test_block_arithmetic():
    assert [num_blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert [num_full_blocks(n, 4) for n in (0, 3, 4, 7, 8)] == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError):
        num_blocks_for(-1, 4)
    with pytest.raises(ValueError):
        num_full_blocks(3, 0)


def test_allocate_slots_grows_in_place_or_takes_nothing():
    kv = KVCacheManager(BlockPool(3), BLOCK)
    table: list[int] = []
    assert kv.allocate_slots(table, 5) and len(table) == 2
    assert kv.allocate_slots(table, 8) and len(table) == 2  # still fits
    assert not kv.allocate_slots(table, 13) and len(table) == 2  # needs 2 more, 1 free
    assert kv.num_free_blocks == 1
    kv.free(table)
    assert table == [] and kv.num_free_blocks == 3


def test_computed_blocks_leave_one_token_to_compute_and_are_referenced():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BLOCK)
    prompt = list(range(12))  # exactly 3 full blocks
    keys = block_keys(prompt, BLOCK, make_namespace("m", None))
    table: list[int] = []
    assert kv.allocate_slots(table, len(prompt))
    written = list(table)
    pool.cache_full_blocks(table, keys)
    kv.free(table)
    hit = kv.get_computed_blocks(keys, len(prompt))
    assert hit == written[:2]  # the third block holds the last token, which must be computed
    assert pool.num_used_blocks == 2  # referenced: eviction cannot take them
    kv.free(hit)
    assert kv.get_computed_blocks(keys, 13) == written  # one more token: all 3 are reusable


def test_admission_is_first_come_first_served_and_stops_at_the_first_misfit():
    scheduler, _ = make(4)
    big, small = Req("big", prompt_len=20), Req("small", prompt_len=2)  # 6 blocks, 1 block
    scheduler.add(big)
    scheduler.add(small)
    assert list(scheduler.admit()) == []  # big does not fit; small does not overtake it
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]
    first = Req("a", prompt_len=6)  # 2 blocks for 6 prompt tokens + the first fed token
    scheduler2, _ = make(4)
    scheduler2.add(first)
    scheduler2.add(Req("b", prompt_len=3))  # 1 block
    scheduler2.add(Req("c", prompt_len=7))  # 2 blocks: only 1 left
    admitted = list(scheduler2.admit())
    assert [r.request_id for r in admitted] == ["a", "b"]
    assert all(r.status is RequestStatus.WAITING_FOR_KV for r in admitted)
    assert [len(r.block_table) for r in admitted] == [2, 1]


def test_growth_preempts_the_newest_and_resumes_it_first():
    scheduler, _ = make(4)
    old, new = Req("old", prompt_len=3, out=1), Req("new", prompt_len=3, out=1)
    for r in (old, new):
        scheduler.add(r)
    for r in scheduler.admit():
        r.status = RequestStatus.RUNNING  # their KV arrived
        r.num_computed_tokens = 3
    later = Req("later", prompt_len=1)
    scheduler.add(later)
    assert [r.request_id for r in scheduler.grow()] == ["old", "new"]
    old.out, new.out = 5, 5  # 8 tokens each: 2 blocks each, 4 in all: still fits
    assert [r.request_id for r in scheduler.grow()] == ["old", "new"]
    new.num_computed_tokens = 7  # every token but the last fed
    old.out = 6  # old needs a third block; none free: the newest (new) is preempted
    assert [r.request_id for r in scheduler.grow()] == ["old"]
    assert new.status is RequestStatus.PREEMPTED and new.block_table == []
    assert [r.request_id for r in scheduler.waiting] == ["new", "later"]
    assert scheduler.num_preemptions_total == 1
    scheduler.finish(old)
    assert list(scheduler.admit()) == [later]  # new resumed first, then later admitted
    assert new.status is RequestStatus.RUNNING and len(new.block_table) == 2
    # nothing computed in its new blocks: its 7 tokens are caught up in chunks, then it decodes
    assert new.num_computed_tokens == 0 and scheduler.preemption.num_recomputed_tokens_total == 7
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(4)] == [("new", 4)]
    new.num_computed_tokens = 4
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(4)] == [("new", 3)]
    new.num_computed_tokens = 7
    assert scheduler.schedule_chunks(4) == []  # caught up but for its last token


def test_the_asking_request_is_preempted_when_it_is_the_newest():
    scheduler, _ = make(2)
    only = Req("only", prompt_len=3, out=1)
    scheduler.add(only)
    for r in scheduler.admit():
        r.status = RequestStatus.RUNNING
    only.out = 10  # 13 tokens: 4 blocks, the cache has 2
    assert scheduler.grow() == []
    assert only.status is RequestStatus.PREEMPTED and scheduler.kv.num_free_blocks == 2


def test_swap_keeps_the_blocks_contents_across_preemption():
    scheduler, cache = make(4, "swap")
    assert isinstance(scheduler.preemption, SwapPreemption)
    a, b = Req("a", prompt_len=3, out=1), Req("b", prompt_len=3, out=1)
    for r in (a, b):
        scheduler.add(r)
    for r in scheduler.admit():
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = 3
    cache.blocks[b.block_table] = torch.tensor([[7.0, 8.0]])
    a.out = 10  # a needs 4 blocks: b goes
    scheduler.grow()
    assert b.status is RequestStatus.PREEMPTED and b.swapped is not None
    scheduler.finish(a)
    list(scheduler.admit())
    assert b.status is RequestStatus.RUNNING and b.swapped is None
    assert torch.equal(cache.blocks[b.block_table], torch.tensor([[7.0, 8.0]]))
    assert b.num_computed_tokens == 3 and scheduler.schedule_chunks(4) == []  # nothing to redo


def test_finish_frees_and_activate_takes_a_request_out_of_turn():
    scheduler, _ = make(4)
    a, b = Req("a", prompt_len=20), Req("b", prompt_len=2)
    scheduler.add(a)
    scheduler.add(b)
    b.block_table = [0]  # e.g. reserved for its announced layer stream
    scheduler.kv.pool.allocate(1)
    scheduler.activate(b, RequestStatus.WAITING_FOR_KV)
    assert scheduler.active == {"b": b} and scheduler.waiting == [a]
    scheduler.finish(b)
    scheduler.finish(a)
    assert scheduler.kv.num_free_blocks == 4 and not scheduler.active and not scheduler.waiting
    assert a.status is b.status is RequestStatus.FINISHED


def test_modes_are_registered_by_name():
    kv = KVCacheManager(BlockPool(2), BLOCK)
    assert isinstance(PREEMPTION_MODES["recompute"](kv, HostCache(2)),
                      RecomputePreemption)
    assert set(PREEMPTION_MODES) == {"recompute", "swap"}


def running(scheduler: Scheduler, *reqs: Req) -> None:
    """Admit `reqs` (prefill-style: they compute their own prompts) and mark them running."""
    for r in reqs:
        scheduler.add(r)
    for r in scheduler.admit():
        r.status = RequestStatus.RUNNING


def test_admission_stops_at_max_num_seqs_and_resumes_when_one_finishes():
    kv = KVCacheManager(BlockPool(64), BLOCK)
    scheduler = Scheduler(kv, None, num_lookahead_tokens=0, max_num_seqs=2)
    a, b, c = Req("a", 8, 0), Req("b", 8, 0), Req("c", 8, 0)
    running(scheduler, a, b, c)
    assert set(scheduler.active) == {"a", "b"} and scheduler.waiting == [c]
    scheduler.finish(a)
    assert [r.request_id for r in scheduler.admit()] == ["c"]
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(kv, None, max_num_seqs=0)


def test_a_chunk_takes_what_the_budget_has_left():
    """vLLM v1 cuts a prompt's chunk to the budget left: after the decode rows (the engine
    passes what they left) and after older requests' chunks."""
    kv = KVCacheManager(BlockPool(64, enable_caching=True), BLOCK)
    scheduler = Scheduler(kv, None, num_lookahead_tokens=0)
    a, b = Req("a", 10, 0), Req("b", 50, 0)
    running(scheduler, a, b)
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(40)] == [("a", 10),
                                                                             ("b", 30)]
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(7)] == [("a", 7)]
    assert scheduler.schedule_chunks(0) == [] and scheduler.schedule_chunks(-3) == []


def test_chunks_fill_the_token_budget_oldest_first():
    kv = KVCacheManager(BlockPool(64, enable_caching=True), BLOCK)
    scheduler = Scheduler(kv, None, num_lookahead_tokens=0)
    a, b, c, d = Req("a", 50, 0), Req("b", 30, 0), Req("c", 20, 0), Req("d", 5, 0)
    running(scheduler, a, b, c, d)
    assert [len(r.block_table) for r in (a, b, c, d)] == [13, 8, 5, 2]  # no lookahead slot
    # a's first chunk is the whole budget: nothing else fits beside it
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(40)] == [("a", 40)]
    a.num_computed_tokens = 40
    # a's last 10, then b's 30: the budget is spent, and neither c nor d overtakes b
    step = scheduler.schedule_chunks(40)
    assert [(r.request_id, n) for r, n in step] == [("a", 10), ("b", 30)]
    a.num_computed_tokens, b.num_computed_tokens = 50, 30
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(40)] == [("c", 20),
                                                                             ("d", 5)]


def test_a_compute_bound_step_takes_no_further_request():
    kv = KVCacheManager(BlockPool(64, enable_caching=True), BLOCK)
    scheduler = Scheduler(kv, None, num_lookahead_tokens=0)
    a, b, c, d = Req("a", 40, 0), Req("b", 40, 0), Req("c", 10, 0), Req("d", 10, 0)
    running(scheduler, a, b, c, d)
    # without the limit a and b share the 100-token step; with it a is enough on its own
    assert [r.request_id for r, _ in scheduler.schedule_chunks(100)] == ["a", "b", "c", "d"]
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(100, 30)] == [("a", 40)]
    a.num_computed_tokens = 40
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(100, 30)] == [("b", 40)]
    b.num_computed_tokens = 40
    # short prompts still share a step until together they reach the limit
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(100, 15)] == [("c", 10),
                                                                                  ("d", 10)]
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(100, 10)] == [("c", 10)]


def test_a_request_that_runs_alone_gets_steps_of_its_own_when_it_is_the_oldest():
    kv = KVCacheManager(BlockPool(64), BLOCK)
    scheduler = Scheduler(kv, None, num_lookahead_tokens=0)
    first, streamed, last = Req("first", 8, 0), Req("s", 30, 0, runs_alone=True), Req("l", 8, 0)
    running(scheduler, first, streamed, last)
    # the oldest is not alone-only: it runs with the younger ones; the streamed one waits
    assert [r.request_id for r, _ in scheduler.schedule_chunks(64)] == ["first", "l"]
    first.num_computed_tokens = last.num_computed_tokens = 8
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(16)] == [("s", 16)]


def test_admission_takes_prefix_hits_first_and_gives_them_back_when_it_waits():
    pool = BlockPool(6)
    kv = KVCacheManager(pool, BLOCK)
    scheduler = Scheduler(kv, None, num_lookahead_tokens=0)
    prompt = list(range(13))  # 3 full blocks + 1 token
    keys = block_keys(prompt, BLOCK, make_namespace("m", None))
    table: list[int] = []
    kv.allocate_slots(table, 12)
    cached = list(table)
    pool.cache_full_blocks(table, keys[:3])
    kv.free(table)
    hog = Req("hog", 8, 0)  # 2 blocks: of the 6, 3 are cached (evictable) and 3 free
    running(scheduler, hog)
    again = Req("again", 13, 0, block_keys=keys[:3])
    scheduler.add(again)
    [admitted] = scheduler.admit()
    assert admitted.block_table[:3] == cached and len(admitted.block_table) == 4
    assert admitted.num_computed_tokens == 12  # the hits count as computed
    assert kv.num_free_blocks == 0
    # a request that cannot get its new blocks waits holding nothing, its hits unreferenced
    scheduler.finish(admitted)
    scheduler.finish(hog)
    scheduler2 = Scheduler(kv, None, num_lookahead_tokens=0)
    running(scheduler2, Req("big", 20, 0))  # 5 of the 6 blocks: evicts 2 of the cached 3
    late = Req("late", 13, 0, block_keys=keys[:3])
    scheduler2.add(late)
    assert list(scheduler2.admit()) == []
    assert late.block_table == [] and late.num_computed_tokens == 0
    assert kv.num_free_blocks == 1


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler, _ = make(8, policy="priority")
    for name, priority in (("a", 1), ("b", 0), ("c", 1), ("d", -3)):
        scheduler.add(Req(name, prompt_len=3, priority=priority))
    assert [r.request_id for r in scheduler.waiting] == ["d", "b", "a", "c"]
    assert [r.request_id for r in scheduler.admit()] == ["d", "b", "a", "c"]
    fcfs, _ = make(8)
    for name, priority in (("a", 1), ("b", 0)):
        fcfs.add(Req(name, prompt_len=3, priority=priority))
    assert [r.request_id for r in fcfs.admit()] == ["a", "b"]  # fcfs ignores priority


def test_priority_policy_preempts_the_lowest_priority_as_vllm_picks_its_victim():
    """vLLM v1 (vllm/v1/core/sched/scheduler.py): the victim is max(running, key=(priority,
    arrival)); here the oldest request, being the least urgent, goes first."""
    scheduler, _ = make(4, policy="priority")
    lax, urgent = Req("lax", prompt_len=3, priority=5), Req("urgent", prompt_len=3, priority=0)
    running(scheduler, lax, urgent)
    victim = max((lax, urgent), key=lambda r: (r.priority, r.arrival))
    urgent.out = 10  # 13 tokens: all 4 blocks, one of them lax's
    assert [r.request_id for r in scheduler.grow()] == ["urgent"]
    assert victim.status is RequestStatus.PREEMPTED and victim is lax
    # back in the queue at its place: after a more urgent newcomer, before a laxer one
    scheduler.add(Req("newer-urgent", prompt_len=1, priority=0))
    scheduler.add(Req("laxest", prompt_len=1, priority=9))
    scheduler.add(Req("same", prompt_len=1, priority=5))
    assert [r.request_id for r in scheduler.waiting] == ["newer-urgent", "lax", "same",
                                                         "laxest"]


def test_priority_policy_orders_a_steps_chunks():
    scheduler, _ = make(16, policy="priority")
    first, second = Req("first", prompt_len=8, priority=2), Req("second", prompt_len=8)
    running(scheduler, first, second)
    assert [(r.request_id, n) for r, n in scheduler.schedule_chunks(10)] == [("second", 8),
                                                                             ("first", 2)]
    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(scheduler.kv, None, policy="lifo")
