"""A prefill instance: the engine core (engine.core.engine_core) whose requests end after their
first token, and the futures its callers wait on.

    submit_prefill ──▶ FirstToken   (output token 0, as soon as it is sampled)
                  └──▶ PrefillResult (once the connectors saved the prompt's KV: their
                                      kv_transfer_params, which the decode needs)

Either future raises instead: RequestRejected (empty or too long prompt), RequestAborted,
KVLoadError (a prefix load failed under --kv-load-failure-policy fail), or the KVStoreError
that failed a save.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from pdcluster.engine.core.engine_core import EngineCore
from pdcluster.engine.core.kv_connector import KVConnector
from pdcluster.engine.core.request import Request, RequestFailed
from pdcluster.engine.protocol import (KV_LOAD_FAILED, FirstToken, KVTransferParams, PrefillRequest,
                                       PrefillResult, TokenDelta)
from pdcluster.engine.runner import ModelRunner
from pdcluster.kvstore.errors import KVLoadError
from pdcluster.kvstore.index import KVIndex, Location
from pdcluster.kvstore.index.device_feed import device_feed


def prefill_core(runner: ModelRunner, connector: KVConnector, worker_id: str, pid: int,
                 index: KVIndex | None = None, node_id: str = "local-node",
                 kv_load_failure_policy: str = "recompute") -> EngineCore:
    """The engine of a prefill instance: its prefix cache's events go to ``index`` as
    (node_id, "device", worker_id) every step, before the KV transfer params of the requests
    the step finished."""
    return EngineCore(runner, connector, worker_id, pid,
                      device_feed(index, Location(node_id, "device", worker_id)),
                      kv_load_failure_policy, num_lookahead_tokens=0,
                      compute_bound_tokens=runner.engine_config
                      .resolved_prefill_compute_bound_tokens())


def submit_prefill(core: EngineCore, request: PrefillRequest) -> tuple[Future, Future]:
    """Queue a prefill. Returns futures of its FirstToken and of its PrefillResult (see the
    module docstring for what they raise)."""
    first: Future = Future()
    result: Future = Future()
    extra: dict = {}

    def emit(delta: TokenDelta) -> None:  # the engine loop
        if delta.token_ids and not first.done():
            extra["compute_end_s"] = time.time()
            first.set_result(FirstToken(
                delta.request_id, delta.token_ids[0], delta.logprobs[0] if delta.logprobs else None,
                delta.decode_worker_id, delta.decode_pid, delta.num_cached_tokens or 0,
                delta.prompt_logprobs))

    def settled(params: KVTransferParams | BaseException) -> None:  # the events thread
        if isinstance(params, BaseException):
            error = _typed(params)
            for future in (first, result):
                if not future.done():
                    future.set_exception(error)
            return
        params = dict(params)
        extra.update(params.pop("extra", {}))
        token = first.result()
        result.set_result(PrefillResult(
            request.request_id, token.token, token.num_cached_tokens, token.prefill_worker_id,
            token.prefill_pid, token.logprob, kv_transfer_params=params, extra=extra))

    core.add_request(Request.of_prefill(request, emit, settled))
    return first, result


def prefill(core: EngineCore, request: PrefillRequest,
            timeout_s: float | None = None) -> PrefillResult:
    """submit_prefill and wait for its PrefillResult (raising what it raises)."""
    return submit_prefill(core, request)[1].result(timeout=timeout_s)


def _typed(error: BaseException) -> BaseException:
    """The engine's error as the gateway tells it apart: a failed KV load is a KVLoadError."""
    if isinstance(error, RequestFailed) and error.error_code == KV_LOAD_FAILED:
        return KVLoadError(str(error))
    return error
