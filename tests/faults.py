"""Actors that break on purpose, for fault tests of a running cluster: the serving classes, each
with an ``inject_fault`` the serving ones do not have, and what tests read that the serving
ones do not keep (a process id to kill, TP ranks, how each request's KV arrived, which requests
shared a decode step). A test cluster runs them through ``deploy.launcher.ActorClasses``
(``Cluster(config, actors=FAULTY)``)."""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import ray
import torch

from pdcluster.decode_worker.actor import DecodeWorker
from pdcluster.deploy.launcher import ActorClasses
from pdcluster.kvstore.actor import KVStoreActor
from pdcluster.kvstore.transport.context import KVConnectorContext
from pdcluster.kvstore.transport.fetch import FetchConnector
from pdcluster.kvstore.transport.dest import CacheDest
from pdcluster.engine.kv_cache_spec import region_view
from pdcluster.engine.protocol import DecodeRequest
from pdcluster.prefill_worker.actor import PrefillWorker
from tests.tracing import MAX_TRACED, TracedFetch, trace_steps


class PerturbingFetch(TracedFetch):
    """The fetch connector, adding ``v_perturbation`` to every V element of the blocks it
    receives from now on (0: off), so a test can prove the output depends on the KV that came
    over the wire. A perturbation keeps every backend on the staged path, where it applies."""

    v_perturbation = 0.0

    def dest(self, table: list[int]) -> CacheDest:
        if not self.v_perturbation:
            return super().dest(table)
        return CacheDest(lambda start, blocks: self._write(table, start, blocks), table, None,
                         (self.cache.block_nbytes,), torch.uint8)

    def _write(self, table: list[int], start: int, blocks) -> None:
        if self.v_perturbation:
            blocks = blocks.clone()  # the backend's blocks are read-only views
            for region in self.cache.spec.regions:
                if region.tensor.name == "v":
                    region_view(blocks, region).add_(self.v_perturbation)
        super()._write(table, start, blocks)


class FaultyDecodeWorker(DecodeWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._steps = trace_steps(self.engine)
        self._prefill_extra: OrderedDict[str, dict] = OrderedDict()

    def _fetch_connector(self, context: KVConnectorContext) -> FetchConnector:
        return PerturbingFetch.from_context(context)

    async def submit(self, request: DecodeRequest, subscriber: str) -> None:
        if request.prefill is not None:
            self._prefill_extra[request.request_id] = dict(request.prefill.extra)
            while len(self._prefill_extra) > MAX_TRACED:
                self._prefill_extra.popitem(last=False)
        await super().submit(request, subscriber)

    async def kv_timings(self, request_id: str) -> dict | None:
        """How the request's KV arrived (TracedFetch.kv_timings, with the prefill's
        ``prefill_extra``); for a layer stream still waiting for its request, its progress;
        None if unknown."""
        timings = self.fetch.kv_timings.get(request_id)
        if timings is None:
            streams = self.engine.pre_arrival
            return streams.progress(request_id) if streams is not None else None
        return {**timings, "prefill_extra": self._prefill_extra.get(request_id, {})}

    async def step_log(self) -> list[tuple[int, tuple[str, ...]]]:
        """(step number, request ids of its decode rows) of the steps since the actor started
        (tests.tracing.trace_steps)."""
        return list(self._steps)

    async def tp_info(self) -> dict:
        """TPInstance.info: every rank's pid, rank, node and KV heads; rank 0's all-reduces."""
        return await asyncio.get_running_loop().run_in_executor(None, self.tp.info)

    async def inject_fault(self, fault: Literal["perturb_v"], value: float) -> None:
        """``"perturb_v"``: PerturbingFetch.v_perturbation = ``value``. Raises ValueError for
        another fault."""
        _known(fault, "perturb_v")
        self.fetch.v_perturbation = float(value)


class FaultyPrefillWorker(PrefillWorker):
    @ray.method(concurrency_group="control")
    def tp_info(self) -> dict:
        """TPInstance.info: every rank's pid, rank, node and KV heads; rank 0's all-reduces."""
        return self.tp.info()

    @ray.method(concurrency_group="control")
    def inject_fault(self, fault: Literal["layer_delay"], value: float) -> None:
        """``"layer_delay"``: sleep ``value`` seconds after every decoder layer's forward (0:
        off), so a test can act while a prefill is mid-way (e.g. abort a layer stream). Raises
        ValueError for another fault."""
        _known(fault, "layer_delay")
        self._layer_delay_s = float(value)
        if not getattr(self, "_delay_hooked", False):
            self._delay_hooked = True
            runner = self.engine.runner
            runner.layer_hooks = _DelayedLayerHooks(runner.layer_hooks,
                                                    lambda: self._layer_delay_s)


class FaultyKVStoreActor(KVStoreActor):
    def pid(self) -> int:
        """This actor's process id (to kill it)."""
        return os.getpid()

    def inject_fault(self, fault: Literal["stop_serving", "stop_heartbeat"]) -> None:
        """``"stop_serving"``: the gRPC data plane goes down while the node keeps heartbeating,
        as a wedged or firewalled store's would: its blocks stay listed but cannot be fetched.
        ``"stop_heartbeat"``: the node lease is no longer renewed, as a hung or partitioned
        node's is not; its locations drop out of lookups within ``node_lease_s``. Raises
        ValueError for another fault."""
        _known(fault, "stop_serving", "stop_heartbeat")
        if fault == "stop_serving":
            self._server.stop(grace=0)
        else:
            self._stop.set()


#: A cluster whose actors take faults.
FAULTY = ActorClasses(prefill=FaultyPrefillWorker, decode=FaultyDecodeWorker,
                      kvstore=FaultyKVStoreActor)


class _DelayedLayerHooks:
    """The connector's layer hooks with a sleep after each layer's save, in the forward
    context, where compiled and eager forwards both run them."""

    def __init__(self, inner, delay_s: Callable[[], float]) -> None:
        self._inner, self._delay_s = inner, delay_s

    def wait_for_layer_load(self, layer: int) -> None:
        if self._inner is not None:
            self._inner.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int) -> None:
        if self._inner is not None:
            self._inner.save_kv_layer(layer)
        time.sleep(self._delay_s())


def _known(fault: str, *known: str) -> None:
    if fault not in known:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(known)}")
