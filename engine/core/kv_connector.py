"""The KV connector: the one interface through which a worker's engine moves KV in or out of
its paged cache. The method names are vLLM v1's (``KVConnectorBase_V1``), so an engineer from
vLLM knows where each step happens.

vLLM splits a connector into a scheduler-side and a worker-side object living in different
processes. A pdcluster worker's engine loop plays both roles on one thread, so one object has
both halves:

* scheduler side
  - ``get_num_new_matched_tokens``: how much of a request's prompt the connector can supply
    beyond the worker's own prefix hits, and whether it arrives asynchronously;
  - ``update_state_after_alloc``: the request now holds its blocks, so plan the load into them;
  - ``request_finished``: the request's compute is done; say what the next hop needs.
* worker side
  - ``build_connector_meta`` / ``bind_connector_metadata``: one metadata object per step, the
    prompt chunks it computes;
  - ``start_load_kv``: start the planned loads, never blocking;
  - ``wait_for_layer_load`` / ``save_kv_layer``: per decoder layer, around its attention
    (inside the forward, compiled or eager);
  - ``wait_for_save``: after each forward;
  - ``get_finished``: the requests whose sends or loads settled since the last call.

Every call comes from the engine loop's thread, except ``abort``, which may come from any
thread (an abort must reach a forward in progress). A connector's own threads do the moving and
call ``wakeup`` when something settled, so an idle loop polls ``get_finished`` at once.

What one end's connectors tell the other's travels as an opaque ``kv_transfer_params`` dict
(engine.protocol.KVTransferParams) that the engine carries and never reads. The transports
themselves live in ``kvstore.transport``, which builds them by name from what a worker has.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdcluster.engine.kv_cache_spec import KVCacheSpec
from pdcluster.engine.protocol import KVTransferParams


class KVConnectorRequest(Protocol):
    """What a connector reads of a request (the engine's own request objects have it all).

    request_id: unique per attempt; block_keys: chained keys of the prompt's full blocks;
    num_prompt_tokens: the prompt's length in tokens; block_table: the cache blocks it holds,
    in position order; num_computed_tokens: tokens whose KV is in those blocks (when the
    scheduler side is asked: the worker's own prefix hits); runs_alone: its forwards have
    steps of their own; max_tokens: output tokens it may generate (1: it ends at its first
    token, so nothing goes on to a decode); kv_transfer_params: what the other end's
    connectors (or the gateway) said for it, None when nothing.
    """

    request_id: str
    block_keys: Sequence[bytes]
    block_table: list[int]
    num_computed_tokens: int
    runs_alone: bool

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...

    @property
    def kv_transfer_params(self) -> KVTransferParams | None: ...


class BlockCache(Protocol):
    """The paged cache as a connector sees it (``ModelRunner.wire_kv``): whole blocks of
    ``spec`` (engine.kv_cache_spec), every KV head, each moved as its bytes, uint8
    [block_nbytes]. At TP=1 it is the PagedKVCache itself, whose memory a one-sided transport
    may address (``blocks``, or ``tensors`` per region)."""

    spec: KVCacheSpec
    block_size: int
    num_layers: int
    block_nbytes: int

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``start .. start + num_tokens`` of a request's prompt, computed in one step."""

    request: KVConnectorRequest
    start: int
    num_tokens: int


@dataclass(frozen=True)
class KVConnectorMetadata:
    """One step as the worker side sees it (vLLM v1's ``KVConnectorMetadata``): the prompt
    chunks it computes, in batch order (decode rows are not listed: they save nothing)."""

    chunks: tuple[ScheduledChunk, ...] = ()


class StepCancelled(RuntimeError):
    """Raised by ``save_kv_layer`` to stop a forward: the request whose KV it saves was aborted. The
    engine ends that request (``args[0]`` is its id); no other request shares the step."""


@dataclass
class LoadOutcome:
    """How a finished load went.

    num_tokens: tokens that landed, a prefix of what was planned: loading stops at the first
    block it cannot get, and the rest is recomputed. tokens_by_tier: of those, by source tier
    ("host", "ssd" on this node, "remote" from another; or the path a fetch took). failures:
    what went wrong on the way.
    """

    num_tokens: int = 0
    tokens_by_tier: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    detail: dict[str, object] = field(default_factory=dict)  # diagnostics (paths, timings)


class KVLoadFailurePolicy:
    """What a worker does with a load that failed for good (KVTransferConfig.
    load_failure_policy: "recompute" or "fail"), and how many it had, by action.
    Raises ValueError for another policy."""

    def __init__(self, policy: str = "recompute") -> None:
        if policy not in ("recompute", "fail"):
            raise ValueError(f"KV load failure policy must be recompute or fail, got {policy!r}")
        self.policy = policy
        self.failures_total = {"recompute": 0, "fail": 0}

    def record(self) -> bool:
        """Count one failed load; True when its request must end with an error."""
        self.failures_total[self.policy] += 1
        return self.policy == "fail"


class KVConnector(abc.ABC):
    """Moves one worker's KV for its requests (see the module docstring)."""

    cache: BlockCache
    wakeup: Callable[[], None] = staticmethod(lambda: None)
    #: its layer hooks (wait_for_layer_load / save_kv_layer) must run inside the forward; a
    #: forward without hooks keeps the fast paths that fuse layers (CUDA graphs, CPU stack)
    uses_layer_hooks: bool = False
    #: what it loads settles without a wakeup call: the engine polls get_finished meanwhile
    polled: bool = False

    def register_kv_caches(self, cache: BlockCache) -> None:
        """The cache this connector moves KV into and out of; called once, before any request."""
        self.cache = cache

    # ---- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: KVConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens after ``num_computed_tokens`` this connector can write into the request's
        blocks, whether they arrive asynchronously: the request then waits for KV). By
        default nothing."""
        return 0, False

    def update_state_after_alloc(self, request: KVConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """The request holds ``block_ids`` (all of its prompt's); the ``num_external_tokens``
        after its computed ones are this connector's to fill."""

    def allows_local_prefix(self, request: KVConnectorRequest) -> bool:
        """Whether the request's KV may start after the worker's own prefix hits. False when
        this connector writes the whole prompt whatever the worker holds (a push sent before
        the worker was asked): the engine then takes no hits for it. By default yes."""
        return True

    @abc.abstractmethod
    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, KVTransferParams | None]:
        """The request leaves the engine; called once for every request, as vLLM does. When
        it ended normally its KV is in ``block_ids`` (its whole block table; ``block_keys``
        then keys every full block of its KV, prompt and output), and what the connector saves
        it copies now; ``block_ids`` is empty when it ended without a result (aborted, failed,
        refused, or stopped on arrival), and nothing is saved. Returns (delay_free: its blocks
        must stay held until get_finished reports it; the KV transfer params the next hop
        needs, or None when they come later from get_finished)."""

    def runs_alone(self, request: KVConnectorRequest) -> bool:
        """Whether the request's forwards must not share a step with another request's (a
        per-layer sender sees one request at a time). By default no."""
        return False

    # ---- worker side ------------------------------------------------------------------------
    def build_connector_meta(self, chunks: Sequence[ScheduledChunk]) -> KVConnectorMetadata:
        """Scheduler side: what the worker side needs of the step about to run."""
        return KVConnectorMetadata(tuple(chunks))

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Worker side: the step about to run (build_connector_meta's)."""

    def start_load_kv(self) -> None:
        """Start every load planned since the last call; never blocks."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Before ``layer``'s attention: its KV must be in place (whole-request loads finish
        before a request runs, so by default there is nothing to wait for)."""

    def save_kv_layer(self, layer: int) -> None:
        """After ``layer``'s attention: its new KV is in the cache. May raise StepCancelled."""

    def wait_for_save(self) -> None:
        """After a forward: what save_kv_layer began must not block the next one."""

    def save_progress(self, request: KVConnectorRequest, keys: Sequence[bytes],
                      block_ids: Sequence[int]) -> None:
        """A running request's first len(keys) blocks are full and will not change (keys: their
        chained keys; block_ids: the blocks holding them): a connector that saves may save
        them now rather than at request_finished. By default nothing."""

    def get_finished(self) -> tuple[dict[str, KVTransferParams | BaseException],
                                    dict[str, LoadOutcome]]:
        """(requests whose sends settled since the last call: request id → their KV transfer
        params, or the exception that failed them; requests whose loads settled: request id →
        how the load went)."""
        return {}, {}

    def abort(self, request_id: str) -> None:
        """The request ended without a result, or its caller left: stop what moves for it and
        drop what was put for it (a load in flight still settles, and is reported, before its
        blocks may be reused). Any thread; idempotent."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        """Let go of threads and channels."""
