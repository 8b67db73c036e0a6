"""What tests read of a running engine that the serving classes do not keep: how each
request's KV arrived (TracedFetch), and which requests shared each decode step (trace_steps)."""

from __future__ import annotations

import time
from collections import OrderedDict, deque

from pdcluster.engine.core.engine_core import EngineCore
from pdcluster.kvstore.transport.fetch import FetchConnector, KVFetch

#: Requests (or steps) a trace keeps, the most recent.
MAX_TRACED = 4096


class TracedFetch(FetchConnector):
    """The fetch connector, keeping per request (the last MAX_TRACED fetched) when its fetch
    started (``fetch_start_s``) and settled (``admitted_s``, time.time()), the paths tried
    (``paths``), a layer stream's per-piece arrivals (``arrivals``: (piece, layer, time.time()))
    and ``failed`` when nothing landed: ``kv_timings``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv_timings: OrderedDict[str, dict] = OrderedDict()

    def _track(self, fetch: KVFetch) -> None:
        super()._track(fetch)
        self.kv_timings[fetch.request_id] = {"fetch_start_s": fetch.started_s}
        while len(self.kv_timings) > MAX_TRACED:
            self.kv_timings.popitem(last=False)

    def get_finished(self):
        sending, loaded = super().get_finished()
        now = time.time()
        for request_id, outcome in loaded.items():
            timings = self.kv_timings.setdefault(request_id, {})
            timings.update(outcome.detail, admitted_s=now)
            if outcome.failures:
                timings["failed"] = True
        return sending, loaded


def trace_steps(core: EngineCore) -> deque[tuple[int, tuple[str, ...]]]:
    """From now on, (step number, request ids of its decode rows) of each step with decode
    rows, the last MAX_TRACED: which requests shared a batch, and when each joined and left.
    Read from the forwards the runner is given (a decode row: the request's last token, fed
    once its other tokens are computed), matched to requests by their block tables."""
    log: deque[tuple[int, tuple[str, ...]]] = deque(maxlen=MAX_TRACED)
    execute = core.runner.execute

    def traced(batch, *args, **kwargs):
        requests = {id(r.block_table): r for r in core.scheduler.active.values()}
        rows = []
        for chunk in batch:
            request = requests.get(id(chunk.block_table))
            if (request is not None and request.output_ids and len(chunk.token_ids) == 1
                    and chunk.num_computed_tokens == request.num_tokens - 1):
                rows.append(request.request_id)
        if rows:
            log.append((core.num_steps_total + 1, tuple(rows)))
        return execute(batch, *args, **kwargs)

    core.runner.execute = traced
    return log
