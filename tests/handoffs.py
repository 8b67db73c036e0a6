"""Reading a PrefillResult's hand-off in tests, as the decode's connectors read it."""

from __future__ import annotations

import dataclasses

from pdcluster.engine.protocol import PrefillResult
from pdcluster.kvstore.handoff import DecodeHandoff


class Handoff:
    """What the prefill's connectors said for a result: the pool's fields (DecodeHandoff)
    and each transport's own keys (``pair_address``, ``pair_tag``, ``kv_region``,
    ``layer_stream``; None, or 0 for the tag, when that transport said nothing)."""

    def __init__(self, params) -> None:
        self._params, self._pool = dict(params or {}), DecodeHandoff.of(params)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if hasattr(self._pool, name):
            return getattr(self._pool, name)
        return self._params.get(name, 0 if name == "pair_tag" else None)


def handoff(result: PrefillResult) -> Handoff:
    """A view of what the prefill's connectors said for ``result``."""
    return Handoff(result.kv_transfer_params)


def with_handoff(result: PrefillResult, **changes: object) -> PrefillResult:
    """``result`` with some of its hand-off's fields changed (a fault to inject)."""
    return dataclasses.replace(result,
                               kv_transfer_params={**result.kv_transfer_params, **changes})


def prefill_result(request_id: str, handoff: DecodeHandoff, first_token: int = 0
                   ) -> PrefillResult:
    """A PrefillResult with this hand-off, as a prefill's connectors would have made it."""
    return PrefillResult(request_id, first_token, 0, "p", 0,
                         kv_transfer_params={f.name: getattr(handoff, f.name)
                                             for f in dataclasses.fields(handoff)})
