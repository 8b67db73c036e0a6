"""The pipeline's side of `--kv-load-failure-policy fail`: a decode worker's KV_LOAD_FAILED
error ends the request with GenerationError (no retry on another instance, which would
recompute it), while its other errors still move the request. The decode worker is a stub
actor handle replaying TokenDeltas: the fault itself (a fetch that fails for good) is
produced by real parts in tests/integration/test_transfer_faults.py."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayTaskError

from pdcluster.engine.protocol import (KV_LOAD_FAILED, DecodeRequest, FinishReason, SamplingParams,
                                       TokenDelta)
from pdcluster.kvstore.errors import KVLoadError, KVTransferError
from pdcluster.router.decode_outputs import DecodeOutputs
from pdcluster.router.pipeline import GenerationError, _Moved, _next_from, _stream_decode
from pdcluster.router.registry import Instance
from tests.router.ray_stubs import Method, Ref, Stream


class _DecodeHandle:
    """Replays `deltas` as one batch of the decode actor's output stream."""

    def __init__(self, deltas) -> None:
        self.outputs = Method(Stream([list(deltas)]))
        self.submit = Method(Ref(None))
        self.abort = Method(None)


def _run(deltas) -> list[TokenDelta]:
    decode = Instance("decode-0", "decode", _DecodeHandle(deltas))
    request = DecodeRequest("r", (1, 2, 3), SamplingParams(max_tokens=4))

    async def consume():
        return [d async for d in _stream_decode(decode, request, DecodeOutputs())]

    return asyncio.run(consume())


def test_a_kv_load_failure_under_the_fail_policy_ends_the_request():
    with pytest.raises(GenerationError, match="KV load failed") as failed:
        _run([TokenDelta("r", (), FinishReason.ERROR, error="KV load failed: refused",
                         error_code=KV_LOAD_FAILED)])
    assert failed.value.status == 503


def test_other_worker_errors_still_move_the_request():
    with pytest.raises(_Moved) as moved:
        _run([TokenDelta("r", (5,)), TokenDelta("r", (), FinishReason.ERROR, error="boom")])
    assert not moved.value.dead and "boom" in str(moved.value)
    assert [d.token_ids for d in _run([TokenDelta("r", (5,)),
                                       TokenDelta("r", (6,), FinishReason.LENGTH)])] == [(5,), (6,)]


class _FailingStream:
    def __init__(self, cause: Exception) -> None:
        self.cause = cause

    async def __anext__(self):
        raise RayTaskError("prefill", "traceback", self.cause)


def test_a_prefill_kv_load_failure_under_the_fail_policy_ends_the_request():
    prefill = Instance("prefill-0", "prefill", None)
    with pytest.raises(GenerationError, match="KV load failed"):
        asyncio.run(_next_from(_FailingStream(KVLoadError("KV load failed: cut")), prefill))
    with pytest.raises(_Moved):  # any other worker error: moved, as before
        asyncio.run(_next_from(_FailingStream(KVTransferError("store down")), prefill))
