"""A worker's request, and the states the scheduler moves it through (vLLM v1's ``Request``).

    WAITING ──admit──▶ WAITING_FOR_KV ──KV landed──▶ RUNNING ──stop / length / abort──▶ FINISHED
       ▲  (blocks for the prompt           (a request with nothing to load
       │   and the first fed token)          skips WAITING_FOR_KV)
       └──── PREEMPTED ◀──no free block for a running request (the newest one goes)

One request type serves every role: a prefill instance's requests end after their first token
(``prefill_only``), a decode instance's arrive with the prefill's first token and KV transfer
params, a colocated one's with neither. In each, ``num_computed_tokens`` catches up to
``num_tokens``: from KV that lands through a connector, or from chunks computed here.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pdcluster.engine.protocol import (DecodeRequest, KVTransferParams, PrefillRequest,
                                       SamplingParams, TokenDelta)
from pdcluster.engine.sampler import TokenEdits, draw_seed


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class RequestRejected(ValueError):
    """The request cannot run here (empty prompt, or longer than max_model_len or than the
    whole cache)."""


class RequestAborted(RuntimeError):
    """The request was aborted before it finished."""


class RequestFailed(RuntimeError):
    """The request ended with an error; ``error_code`` says what kind when a caller must tell
    it apart (engine.protocol.KV_LOAD_FAILED)."""

    def __init__(self, message: str, error_code: str | None = None) -> None:
        super().__init__(message)
        self.error_code = error_code


class SchedulableRequest(Protocol):
    """A request as the scheduler sees it.

    num_tokens: prompt plus output tokens so far; num_prompt_tokens: the prompt's length;
    block_table: the cache blocks it holds, in position order (grown and emptied in place);
    arrival: set by the scheduler, increasing in arrival order;
    block_keys: prefix-cache keys of the prompt's full blocks that admission looks up (empty:
    nothing is looked up);
    num_computed_tokens: tokens whose KV is in its blocks (set on admission from the prefix
    hits, counted up by the engine as chunks and decode steps run or KV lands; back to what the
    blocks still hold after a preemption by recompute or a failed load, from where the
    scheduler catches it up in chunks again);
    runs_alone: its forwards must not share a step with another request's;
    priority: its scheduling priority (lower first), read under the priority policy only.
    """

    request_id: str
    status: RequestStatus
    block_table: list[int]
    arrival: int
    block_keys: Sequence[bytes]
    num_computed_tokens: int
    runs_alone: bool

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def priority(self) -> int: ...


#: Where a prefill-only request's KV transfer params go once its connectors settled them (on
#: the engine's events thread, after the cache events of its step), or the error it ended with.
KVTransferCallback = Callable[[KVTransferParams | BaseException], None]


@dataclass(eq=False)  # a request is itself: queues compare by identity
class Request:
    """One request on a worker's engine (the scheduler's SchedulableRequest and the
    connectors' KVConnectorRequest).

    emit: receives the request's TokenDeltas, on the engine loop, the last with finish_reason.
    output_ids: output tokens so far (a decode's request arrives with the prefill's token 0).
    kv_transfer_params: what the other end's connectors (or the gateway) said for it.
    prefill_only: it ends after its first token; its connectors then save its KV and
        ``on_kv_transfer_params`` gets their params.
    remote_prefill: its prompt was computed elsewhere (it came with token 0 and params): its
        prompt's KV loads through a connector, and the prefill counted its prefix hits.
    block_keys: the prompt's full-block keys admission looks up; at a normal finish, the keys
        of every full block of its KV (what a connector saves).
    prompt_keys: the prompt's full-block keys, cached once its KV is all there.
    num_cached_tokens: prompt tokens the prefix cache served (device hits and loads).
    num_forward_tokens: decode rows it ran here.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    emit: Callable[[TokenDelta], None]
    seed: int
    cache_salt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    kv_transfer_params: KVTransferParams | None = None
    prefill_only: bool = False
    on_kv_transfer_params: KVTransferCallback | None = None
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    arrival: int = 0
    block_keys: Sequence[bytes] = ()
    prompt_keys: Sequence[bytes] = ()
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_forward_tokens: int = 0
    num_published_blocks: int = 0  # leading full blocks saved while it ran
    runs_alone: bool = False
    aborted: bool = False
    swapped: torch.Tensor | None = None  # host copy of its KV while preempted by swap
    #: the llguidance matcher of its structured output, advanced by every output token
    #: (engine.core.structured_output); None: free text
    grammar: Any = None
    #: the grammar holds for the next token (its reasoning, if any, has ended)
    grammar_on: bool = False
    #: with SamplingParams.prompt_logprobs: the entries of the prompt tokens computed so far
    prompt_logprobs: list = field(default_factory=list)

    @classmethod
    def of_prefill(cls, request: PrefillRequest, emit: Callable[[TokenDelta], None],
                   on_kv_transfer_params: KVTransferCallback) -> Request:
        """A prefill instance's request: it ends after output token 0."""
        return cls(request.request_id, tuple(request.prompt_token_ids), request.sampling, emit,
                   _seed(request.sampling), request.cache_salt,
                   kv_transfer_params=request.kv_transfer_params, prefill_only=True,
                   on_kv_transfer_params=on_kv_transfer_params)

    @classmethod
    def of_decode(cls, request: DecodeRequest, emit: Callable[[TokenDelta], None]) -> Request:
        """A decode instance's request: after a prefill (its token 0 and params), or colocated
        (``request.prefill`` None: its prompt is computed here)."""
        prefill = request.prefill
        return cls(request.request_id, tuple(request.prompt_token_ids), request.sampling, emit,
                   _seed(request.sampling), request.cache_salt,
                   output_ids=[prefill.first_token] if prefill is not None else [],
                   kv_transfer_params=prefill.kv_transfer_params if prefill else None)

    def full_output(self) -> list[int]:
        """Every output token, those made before a migration (the prompt's output_offset
        tail, SamplingParams.output_offset) first."""
        k = self.sampling.output_offset
        return [*self.prompt_token_ids[len(self.prompt_token_ids) - k:], *self.output_ids] \
            if k else list(self.output_ids)

    def grammar_start(self) -> int | None:
        """Where in full_output() the grammar starts: after the first reasoning end
        (SamplingParams.reasoning_end_token_ids; 0 without one); None before it."""
        end, output = self.sampling.reasoning_end_token_ids, self.full_output()
        if not end:
            return 0
        for i in range(len(output) - len(end) + 1):
            if tuple(output[i:i + len(end)]) == end:
                return i + len(end)
        return None

    @functools.cached_property
    def token_edits(self) -> TokenEdits | None:
        """Its allowed_token_ids and logit_bias as tensors, built at its first sampling."""
        return TokenEdits.of(self.sampling)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It computes its prompt here and reports the prompt's logprobs."""
        return self.sampling.prompt_logprobs is not None and not self.remote_prefill

    @property
    def remote_prefill(self) -> bool:
        return self.kv_transfer_params is not None and not self.prefill_only

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_ids)

    @property
    def priority(self) -> int:
        return self.sampling.priority

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output tokens so far."""
        return [*self.prompt_token_ids, *self.output_ids]

    def kv_token_ids(self) -> list[int]:
        """The tokens whose KV the request holds: all but the last output token (the next
        step feeds that one); before its first output token, the prompt's computed chunks."""
        if not self.output_ids:
            return list(self.prompt_token_ids[:self.num_computed_tokens])
        return [*self.prompt_token_ids, *self.output_ids[:-1]]


def _seed(sampling: SamplingParams) -> int:
    return sampling.seed if sampling.seed is not None else draw_seed()
