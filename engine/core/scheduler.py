"""The scheduler of a worker's engine loop: request queues, admission by free blocks, growth
and preemption (vLLM v1's `Scheduler`, without its per-feature branches).

    waiting (FCFS; preempted ones at the head) ──admit()──▶ active ──finish()──▶ gone
                         ▲                                    │
                         └──────── preempt() ◀── grow(): no block for the next token

Admission is first come, first served and stops at the first request that does not fit, so a
large request is never overtaken for ever; an admitted request first takes its prompt's cached
blocks (prefix hits), then new ones. A preempted request resumes (through the preemption
policy) before any new one. `grow()` gives every running request the blocks its next step
needs, oldest first; when none is free the newest running request is preempted.
`schedule_chunks()` picks a step's chunks under what the step's token budget has left after
its decode rows (vLLM v1: one budget, ``max_num_batched_tokens``, counts every scheduled token):
every running request whose ``num_computed_tokens`` is behind catches up in them, whether it is
a new prompt, one resumed after preemption by recompute, or one whose KV load failed.
Admission stops at ``max_num_seqs`` admitted requests, so a step's decode rows never outnumber
them. What a newly admitted request does next (load its KV, or compute its prompt) is the
engine's business.

Under the `priority` policy (vLLM's `--scheduling-policy priority`) "oldest" everywhere above
reads "first by (priority, arrival)", a lower priority value first: the waiting queue is kept in
that order (a preempted request goes back to its place in it, ahead of newer ones of its
priority), running requests get blocks and chunks in it, and the victim of a preemption is the
last in it, as vLLM v1's scheduler picks `max(running, key=(priority, arrival_time))`.
Not thread-safe: the engine loop is its only user.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

from pdcluster.engine.core.kv_cache_manager import KVCacheManager
from pdcluster.engine.core.preemption import PreemptionPolicy
from pdcluster.engine.core.request import RequestStatus, SchedulableRequest
from pdcluster.engine.protocol import FinishReason

if TYPE_CHECKING:
    from pdcluster.engine.core.request import Request

R = TypeVar("R", bound=SchedulableRequest)


class Scheduler(Generic[R]):
    """Queues and block accounting of one worker's requests.

    Args:
        kv: the worker's KV cache manager.
        preemption: how a preempted request gives its blocks up and gets them back; None for
            a worker whose requests never grow past admission (prefill), so never preempt.
        num_lookahead_tokens: slots admission reserves beyond the prompt: 1 where the request
            goes on to decode (its first fed token), 0 for a prefill-only worker.
        policy: "fcfs" (arrival order) or "priority" (by the requests' `priority`, then
            arrival; module docstring).
        max_num_seqs: at most this many requests admitted at once (vLLM's ``max_num_seqs``);
            None: only blocks bound them.

    Attributes:
        waiting: requests not admitted yet, in admission order.
        active: admitted requests (waiting for KV or running), by id.
        num_preemptions_total: preemptions so far.
    """

    def __init__(self, kv: KVCacheManager, preemption: PreemptionPolicy | None,
                 num_lookahead_tokens: int = 1,
                 policy: Literal["fcfs", "priority"] = "fcfs",
                 max_num_seqs: int | None = None) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {policy!r}")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.by_priority = policy == "priority"
        self.kv = kv
        self.num_lookahead_tokens = num_lookahead_tokens
        self.preemption = preemption
        self.waiting: list[R] = []
        self.active: dict[str, R] = {}
        self.num_preemptions_total = 0
        self._arrivals = 0

    def add(self, request: R) -> None:
        """Queue a new request (status WAITING) behind the others."""
        self._arrivals += 1
        request.arrival = self._arrivals
        request.status = RequestStatus.WAITING
        if self.by_priority:
            bisect.insort(self.waiting, request, key=self._order)
        else:
            self.waiting.append(request)

    def has_preempted(self) -> bool:
        """Whether a preempted request waits to resume (fcfs: it comes before anything
        new)."""
        return any(r.status is RequestStatus.PREEMPTED for r in self.waiting)

    def find_waiting(self, request_id: str) -> R | None:
        return next((r for r in self.waiting if r.request_id == request_id), None)

    def activate(self, request: R, status: RequestStatus) -> None:
        """Move a waiting request into the active set out of turn (it already holds blocks,
        e.g. reserved by KV that landed before it arrived), max_num_seqs aside."""
        self.waiting.remove(request)
        request.status = status
        self.active[request.request_id] = request

    def admit(self) -> Iterator[R]:
        """Admit waiting requests, first come first served, while blocks last.

        A preempted request is resumed by the preemption policy and runs again; a new one gets
        the cached blocks of its prompt's leading ``block_keys`` (its ``num_computed_tokens``
        then counts them) and new blocks for the rest of its prompt plus the lookahead tokens,
        and is yielded (status WAITING_FOR_KV): the caller starts its KV and may finish it.
        Stops at the first request that does not fit, and once ``max_num_seqs`` are admitted.
        """
        while self.waiting and (self.max_num_seqs is None
                                or len(self.active) < self.max_num_seqs):
            request = self.waiting[0]
            if request.status is RequestStatus.PREEMPTED:
                if not self.preemption.resume(request):
                    return
                self.waiting.pop(0)
                request.status = RequestStatus.RUNNING
                self.active[request.request_id] = request
                continue
            if not request.block_table:
                request.block_table += self.kv.get_computed_blocks(request.block_keys,
                                                                   request.num_prompt_tokens)
                request.num_computed_tokens = len(request.block_table) * self.kv.block_size
            if not self.kv.allocate_slots(request.block_table, request.num_prompt_tokens
                                          + self.num_lookahead_tokens):
                self.kv.free(request.block_table)  # its hits may be evicted while it waits
                request.num_computed_tokens = 0
                return
            self.waiting.pop(0)
            request.status = RequestStatus.WAITING_FOR_KV
            self.active[request.request_id] = request
            yield request

    def grow(self) -> list[R]:
        """The running requests, oldest first, each holding the blocks its next step needs
        (its tokens so far); the newest are preempted while blocks are short (possibly the one
        asking)."""
        running = sorted((r for r in self.active.values() if r.status is RequestStatus.RUNNING),
                         key=self._order)
        for request in list(running):
            while request in running and \
                    not self.kv.allocate_slots(request.block_table, request.num_tokens):
                self._preempt(running.pop())
        return running

    def schedule_chunks(self, token_budget: int,
                        compute_bound_tokens: int | None = None) -> list[tuple[R, int]]:
        """This step's chunks (vLLM's chunked prefill), as (request, tokens to compute), at most
        ``token_budget`` tokens in all (what the step's budget has left after its decode rows;
        0 or less: none).

        A request catches up to :func:`chunk_end`: its whole prompt while it has no output
        (the last chunk's logits give output token 0), else every token but the last output
        token, which a decode step feeds. The running requests behind take their next chunk,
        oldest first, each as many of those tokens as the budget has left (vLLM v1 cuts a
        chunk to the budget the same way), until the budget is spent, so nobody overtakes
        an older request. A request whose ``runs_alone`` is set (forward hooks that must see
        it alone) runs in a step of its own, when it is the oldest; younger ones go on
        without it meanwhile.

        ``compute_bound_tokens`` (None: no such limit): a step that already holds this many
        tokens takes no further request. Past the size where a step's forward is
        compute-bound, packing another prompt into it gains no throughput and only delays the
        first token of every prompt already in it (DistServe, OSDI '24, section 3.1).
        """
        pending = sorted((r for r in self.active.values() if r.status is RequestStatus.RUNNING
                          and r.num_computed_tokens < chunk_end(r)),
                         key=self._order)
        step: list[tuple[R, int]] = []
        used = 0
        for request in pending:
            if used >= token_budget or (
                    step and compute_bound_tokens is not None and used >= compute_bound_tokens):
                break
            size = min(chunk_end(request) - request.num_computed_tokens, token_budget - used)
            if request.runs_alone:
                if not step:
                    return [(request, size)]
                continue
            step.append((request, size))
            used += size
        return step

    def finish(self, request: R) -> None:
        """The request leaves (done, aborted or failed): its blocks go back to the pool."""
        self.active.pop(request.request_id, None)
        if request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.block_table)
        request.status = RequestStatus.FINISHED

    def _preempt(self, request: R) -> None:
        if self.preemption is None:
            raise RuntimeError("this scheduler's requests grow past admission but it has no "
                               "preemption policy")
        self.preemption.preempt(request)
        request.status = RequestStatus.PREEMPTED
        del self.active[request.request_id]
        if self.by_priority:
            bisect.insort(self.waiting, request, key=self._order)
        else:
            self.waiting.insert(0, request)
        self.num_preemptions_total += 1

    def _order(self, request: R) -> tuple[int, int]:
        return (request.priority if self.by_priority else 0, request.arrival)


def chunk_end(request: SchedulableRequest) -> int:
    """Where a request's chunks stop: the end of its prompt while it has no output token, else
    its last output token, which a decode step feeds (so a recomputed request's last token
    runs as every other decode token does)."""
    if request.num_tokens == request.num_prompt_tokens:
        return request.num_prompt_tokens
    return request.num_tokens - 1


def check_stop(request: Request, eos_token_ids: AbstractSet[int],
               max_model_len: int) -> FinishReason | None:
    """Whether the request ends with the output token just appended (vLLM v1's
    ``check_stop``): STOP on EOS (unless ``ignore_eos``), one of its stop token ids or a
    finished grammar; LENGTH at ``max_tokens`` or ``max_model_len``, and at once for a
    prefill-only request (its first token is all it computes). None: it goes on. Stop strings
    are the detokenizer's (the gateway's)."""
    if request.prefill_only:
        return FinishReason.LENGTH
    params = request.sampling
    last = request.output_ids[-1]
    if (not params.ignore_eos and last in eos_token_ids) or last in params.stop_token_ids:
        return FinishReason.STOP
    if request.grammar_on and request.grammar.is_stopped():
        return FinishReason.STOP  # the grammar is complete: only EOS could follow
    if len(request.output_ids) >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
