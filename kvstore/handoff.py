"""What pdcluster's connectors put in the ``kv_transfer_params`` dicts (vLLM v1's name) and
read back out of them.

The engine carries these dicts and never reads them: the gateway's go into a
PrefillRequest for the prefill's connectors, and what the prefill's connectors return from
``request_finished`` / ``get_finished`` goes, inside the PrefillResult, to the decode's
connectors. The dataclasses here are the typed views both ends agree on; the dicts stay plain
(str keys, values the control plane can carry), so a new transport adds keys, not fields in
engine.protocol.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from pdcluster.kvstore.index.base import Location


@dataclass(frozen=True)
class PrefixPlan:
    """The Conductor's plan for a prompt's cached prefix, so the prefill worker need not ask
    the global index again.

    block_keys: chained keys of the prompt's full blocks, as the Conductor computed them (the
        worker checks them against its own and ignores a plan whose keys differ).
    locations: where the index holds each of the prompt's leading blocks (its longest cached
        prefix), in prompt order.
    num_load_blocks: how many leading blocks the worker reuses (its own G1, then loads); the
        rest it recomputes: Mooncake FAST'25 Algorithm 1's pull-or-recompute, decided by the
        Conductor's prefill policy (router.policies: PrefillPlan.cached_blocks).
    """

    block_keys: tuple[bytes, ...]
    locations: tuple[tuple[Location, ...], ...]
    num_load_blocks: int


@dataclass(frozen=True)
class PrefillHandoff:
    """What the gateway asks of a prefill's connectors (PrefillRequest.kv_transfer_params).

    decode_peer: worker id of the decode instance the Conductor picked; the pushing
        connectors (torch pair, layer stream) send the prompt's KV to it. None: no push (the
        decode pulls from the KV store).
    prefix_plan: the Conductor's prefix plan; None: the worker looks its prefix up itself.
    """

    decode_peer: str | None = None
    prefix_plan: PrefixPlan | None = None

    def to_params(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def of(cls, params: Mapping[str, object] | None) -> PrefillHandoff:
        return _view(cls, params)


@dataclass(frozen=True)
class DecodeHandoff:
    """What the prefill's pool connector tells the decode's (PrefillResult.kv_transfer_params):
    where the prompt's blocks wait in the pool, every transport's fallback. A transport's own
    keys (a pair address, a Transfer Engine region, a layer stream's announce) sit beside
    these in the same dict and are read only by that transport's source
    (kvstore.transport.source).

    kv_address: ``host:port`` of the KV store holding the prompt's blocks; kv_node_id: its
        Ray node (same node: read through its arena).
    block_keys: chained sha256 keys of the prompt's full blocks, published on that store.
    tail_handle: handle of the partial tail block on that store (None when the prompt length
        is a multiple of the block size); never keyed or indexed. num_tail_tokens: its tokens.
    """

    kv_address: str = ""
    block_keys: tuple[bytes, ...] = ()
    tail_handle: str | None = None
    num_tail_tokens: int = 0
    kv_node_id: str | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.block_keys) + (self.tail_handle is not None)

    def num_tokens(self, block_size: int) -> int:
        """The prompt tokens these blocks hold, ``block_size`` tokens per full block."""
        return len(self.block_keys) * block_size + self.num_tail_tokens

    @classmethod
    def of(cls, params: Mapping[str, object] | None) -> DecodeHandoff:
        return _view(cls, params)


def _view(cls, params: Mapping[str, object] | None):
    """The dataclass ``cls`` from the keys of ``params`` it names (others belong to other
    connectors, e.g. ``extra``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in (params or {}).items() if k in names})
