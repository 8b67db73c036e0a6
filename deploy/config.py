"""The one typed config of a pdcluster deployment, built once at the CLI edge.

Sources, later wins: defaults < YAML file (`--config`) < CLI flags. Environment variables are
read only by the CLI, never below it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from pdcluster.engine import cpu_binding
from pdcluster.engine.config import EngineConfig
from pdcluster.kvstore.config import (PREFER_CROSS_LAYER_BLOCKS, KVStoreConfig,
                                      KVTransferConfig)
from pdcluster.kvstore.pool_config import KVPoolConfig

DEFAULT_MAX_SEQS_PER_REQUEST = 64


class ServeConfig(BaseModel):
    """Everything `pdcluster serve` needs.

    ray_num_cpus: logical CPUs the LOCAL Ray is started with (ignored with `address`). Ray CPUs
        are logical: this only has to cover every actor's `actor_num_cpus` so none stays
        pending; real CPU use is governed by `engine.torch_threads` per actor.
    actor_num_cpus: logical CPUs each prefill/decode actor reserves (KV store actors reserve 0).
    actor_num_gpus: GPUs each prefill/decode actor reserves; None: 1 when `engine.device` is
        cuda, else 0 (a fraction shares a GPU, e.g. 0.5 for prefill and decode on one GPU).
    placement: where worker actors run (deploy/placement.py): "auto" asks for the Ray custom
        resource of the actor's role (`prefill`, `decode`) when some node advertises it, and a
        local Ray advertises both; "resources" always (fails fast if no node does); "none"
        never. Only nodes that may run workers get a KV store.
    cpu_bind (``--cpu-bind``): pinning of the CPU workers' torch threads, one per core
        (engine.cpu_binding). "auto": each worker claims free cores of its node; a local Ray
        on a machine with more cores than the workers' threads sets those cores aside for the
        workers and starts Ray's own processes (GCS, raylet, KV stores) on the rest, and when
        the threads outnumber the cores nothing is pinned. "none": no pinning. A cpu list
        ("0-7"): the cores every node's workers claim from. It becomes each worker's
        engine.cpu_bind.
    worker_preload (``--worker-preload``): "auto" starts the worker actors with tcmalloc
        preloaded where installed (deploy/preload.py); "none" preloads nothing.
    worker_huge_pages (``--worker-huge-pages``): "auto" starts the worker actors with torch's
        large CPU tensors on transparent huge pages where the kernel grants them
        (deploy/preload.py); "none" leaves them on the kernel's default pages.
    colocated: each decode instance also prefills its requests (no prefill actors, no KV
        transfer) — for comparison and one-GPU deployments.
    drain_timeout_s: on SIGTERM the gateway stops admitting (503 + Retry-After, /health 503
        "draining") and in-flight requests get this long, in seconds, to finish before they
        end with an error event and the workers stop (deploy/serve.py).
    max_inflight_requests: sequences (each choice of each prompt) the gateway lets run at
        once (router/inflight.py). The workers' own queues are not bounded, so this is the
        cluster's bound.
    max_queued_sequences: sequences that may wait for the gate, released round-robin across
        requests; a request that does not fit gets 503 + Retry-After. None: 4 x the gate.
    max_seqs_per_request: prompts x n one request may ask for; over it a 400. At most half
        of max_inflight_requests, so no single request can fill the gate. None: 64, or half
        the gate when that is less.
    header_timeout_s: a connection that has not sent a complete request head within this
        many seconds is closed by the gateway (deploy/http_protocol.py).
    body_timeout_s: a connection whose request body stops arriving for this many seconds
        (between two reads, as nginx's client_body_timeout) is closed.
    keep_alive_timeout_s: how long a connection may wait idle between requests before the
        gateway closes it; nginx's default, longer than clients' pools keep a connection
        (deploy/http_protocol.py says why).
    max_connections: connections the gateway keeps open at once; past it a new one replaces
        the longest idle one, and with none idle is answered 503 and closed at once. None:
        the gate and its queue (max_inflight_requests + max_queued_sequences) + 256, so the
        gate's own 503 (with its OpenAI error body and Retry-After) is what a client over
        the gate sees, and probes still get in.
    log_format: "text" or "json" (one JSON object per line with timestamp, level, logger,
        message and, for a record about a request, request_id; engine/logs.py).
    api_keys / api_key_file: when any key is set, every request but /health needs
        `Authorization: Bearer <key>` (keys are never logged).
    tool_call_parser / enable_auto_tool_choice: vLLM's flags: how calls are read out of a
        model's text (router.tool_parsers), and whether tool_choice "auto" is served (it
        needs a parser).
    reasoning_parser: vLLM's flag: a reasoning model's thinking goes to a chat message's
        `reasoning` (router.reasoning); None: all output is content.
    worker_stall_timeout_s: a worker running requests whose engine takes no step for this
        many seconds (or that stops answering) is declared hung, restarted, and its requests
        migrate (router.stall_watch); 0: not watched.
    autoscale / autoscale_interval_s: ``prefill=MIN:MAX,decode=MIN:MAX``: the SLO planner
        (router.planner, run by deploy.autoscaler every interval) adds workers when the
        interval's TTFT or TBT breaches its SLO (or the queues or the KV say it will) and
        drains one when fewer carry the load; prefill_instances / decode_instances are the
        counts at start, within the range. None: fixed counts.
    transfer: how KV gets from prefill to decode (``--kv-transfer grpc|torch|mooncake``). The
        KV plane's token, TLS and gRPC message size are `kvstore`'s (``--kv-token``,
        ``--kv-tls-*``), for stores and transfers alike.
    policy / admission / slo_ttft_s / slo_tbt_ms / cost_model: the Conductor
        (router/conductor.py): a policy of router.policies.POLICIES (default kvcache_centric,
        Mooncake FAST'25 Alg. 1), SLO admission (arrival-2407.00079 §6; none by default: a
        rejection is a 429 with Retry-After), the SLOs it enforces, and the cost model it
        predicts with (a built-in name of router.cost_model or a `pdcluster profile` file).
    engine.tensor_parallel_size (``--tensor-parallel-size``, vLLM's flag): tensor parallel
        size of every prefill and decode instance: k actors (ranks) in one STRICT_PACK
        placement group (engine.tp_instance); each reserves actor_num_cpus (and one GPU on
        CUDA).
    prefill_tp / decode_tp (``--prefill-tp`` / ``--decode-tp``): that size for one role only;
        None (the default): engine.tensor_parallel_size. They override it rather than copy
        it, so nothing needs keeping in sync: prefill_engine() and decode_engine() are the
        only places a role's size is resolved, and the launcher builds each worker from them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(default_factory=EngineConfig)
    kvstore: KVStoreConfig = Field(default_factory=KVStoreConfig)
    kvpool: KVPoolConfig = Field(default_factory=KVPoolConfig)
    transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, lt=65536)
    served_model_name: str | None = None
    prefill_instances: int = Field(1, ge=1)
    decode_instances: int = Field(1, ge=1)
    prefill_tp: int | None = Field(None, ge=1)
    decode_tp: int | None = Field(None, ge=1)
    policy: str = "kvcache_centric"
    pd_decider: str = "cost"
    admission: Literal["none", "arrival", "prediction"] = "none"
    slo_ttft_s: float = Field(30.0, gt=0)
    slo_tbt_ms: float = Field(100.0, gt=0)
    cost_model: str = "stories260k-cpu"
    colocated: bool = False
    address: str | None = None
    ray_namespace: str = "pdcluster"
    ray_num_cpus: int | None = Field(None, ge=1)
    actor_num_cpus: float = Field(1.0, gt=0)
    actor_num_gpus: float | None = Field(None, ge=0)
    placement: Literal["auto", "resources", "none"] = "auto"
    cpu_bind: str = "auto"
    worker_preload: Literal["auto", "none"] = "auto"
    worker_huge_pages: Literal["auto", "none"] = "auto"
    log_level: str = "info"
    drain_timeout_s: float = Field(30.0, ge=0)
    max_inflight_requests: int = Field(256, ge=1)
    max_queued_sequences: int | None = Field(None, ge=0)
    max_seqs_per_request: int | None = Field(None, ge=1)
    header_timeout_s: float = Field(30.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    keep_alive_timeout_s: float = Field(75.0, gt=0)
    max_connections: int | None = Field(None, ge=1)
    log_format: Literal["text", "json"] = "text"
    max_request_body_bytes: int = Field(4 << 20, ge=1024)
    api_keys: list[SecretStr] = Field(default_factory=list)
    api_key_file: str | None = None
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    enable_auto_tool_choice: bool = False
    worker_stall_timeout_s: float = Field(30.0, ge=0)
    autoscale: str | None = None
    autoscale_interval_s: float = Field(10.0, gt=0)

    @field_validator("autoscale")
    @classmethod
    def _autoscale_range(cls, spec: str | None) -> str | None:
        from pdcluster.router.planner import AutoscaleRange

        return None if spec is None else str(AutoscaleRange.parse(spec))

    def autoscale_range(self):
        """--autoscale as a router.planner.AutoscaleRange, None when off."""
        from pdcluster.router.planner import AutoscaleRange

        return None if self.autoscale is None else AutoscaleRange.parse(self.autoscale)

    @field_validator("cpu_bind")
    @classmethod
    def _cpu_list(cls, value: str) -> str:
        return cpu_binding.validate_cpu_bind(value)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        from pdcluster.router.policies import POLICIES

        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; one of {sorted(POLICIES)}")
        return policy

    @field_validator("pd_decider")
    @classmethod
    def _known_pd_decider(cls, spec: str) -> str:
        from pdcluster.router.pd_decider import PDDecider

        return str(PDDecider.parse(spec))

    @model_validator(mode="after")
    def _cap_within_gate(self) -> "ServeConfig":
        if self.max_seqs_per_request is not None and \
                self.max_seqs_per_request > max(1, self.max_inflight_requests // 2):
            raise ValueError(
                f"max_seqs_per_request ({self.max_seqs_per_request}) must be at most half of "
                f"max_inflight_requests ({self.max_inflight_requests})")
        if self.autoscale is not None and self.colocated:
            raise ValueError("autoscale scales prefill and decode workers apart; it does not "
                             "apply to colocated workers")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (vLLM's rule)")
        from pdcluster.kvstore.transport.registry import check_settings

        check_settings(self.transfer)  # the transport's own section, by the transport
        return self

    def resolved_max_seqs_per_request(self) -> int:
        if self.max_seqs_per_request is not None:
            return self.max_seqs_per_request
        return min(DEFAULT_MAX_SEQS_PER_REQUEST, max(1, self.max_inflight_requests // 2))

    def resolved_max_connections(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        return self.max_inflight_requests + self.resolved_max_queued_sequences() + 256

    def resolved_max_queued_sequences(self) -> int:
        if self.max_queued_sequences is not None:
            return self.max_queued_sequences
        return 4 * self.max_inflight_requests

    def prefill_engine(self) -> EngineConfig:
        """The engine config of each prefill instance: `engine`, with prefill_tp as its
        tensor_parallel_size when set and its kv_cache_layout resolved
        (`resolved_kv_cache_layout`)."""
        return self._role_engine(self.prefill_tp)

    def decode_engine(self) -> EngineConfig:
        """The engine config of each decode instance: `engine`, with decode_tp as its
        tensor_parallel_size when set and its kv_cache_layout resolved."""
        return self._role_engine(self.decode_tp)

    def resolved_kv_cache_layout(self) -> str:
        """`engine.kv_cache_layout`, or for "auto" the layout the KV connector prefers, as
        vLLM's connectors state theirs (`prefer_cross_layer_blocks`): "cross-layer" for
        Mooncake's Transfer Engine moving whole requests (`--kv-transfer mooncake`, request
        streaming: a run of consecutive blocks is then one read instead of one per layer and
        K|V), else "layer" (layer streams send each layer's K and V as it is computed)."""
        if self.engine.kv_cache_layout != "auto":
            return self.engine.kv_cache_layout
        if (not self.colocated and self.transfer.backend in PREFER_CROSS_LAYER_BLOCKS
                and self.transfer.streaming == "request"):
            return "cross-layer"
        return "layer"

    def _role_engine(self, tp: int | None) -> EngineConfig:
        update: dict[str, Any] = {"kv_cache_layout": self.resolved_kv_cache_layout()}
        if tp is not None:
            update["tensor_parallel_size"] = tp
        return self.engine.model_copy(update=update)

    def local_worker_threads(self) -> int:
        """Torch threads of every worker actor (every TP rank) of a one-node deployment."""
        prefill = 0 if self.colocated else \
            self.prefill_instances * self.prefill_engine().tensor_parallel_size
        decode = self.decode_instances * self.decode_engine().tensor_parallel_size
        return (prefill + decode) * self.engine.torch_threads

    def local_ray_num_cpus(self) -> int:
        """Logical CPUs for a local Ray: all worker actors (every TP rank) plus 2 spare."""
        if self.ray_num_cpus is not None:
            return self.ray_num_cpus
        prefill = 0 if self.colocated else \
            self.prefill_instances * self.prefill_engine().tensor_parallel_size
        decode = self.decode_instances * self.decode_engine().tensor_parallel_size
        return int((prefill + decode) * self.actor_num_cpus) + 2

    def worker_num_gpus(self) -> float:
        """GPUs each prefill/decode actor reserves (actor_num_gpus, or 1 on cuda, else 0)."""
        if self.actor_num_gpus is not None:
            return self.actor_num_gpus
        return 1.0 if self.engine.device.startswith("cuda") else 0.0

    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).name


def load_config(path: str | Path | None, overrides: dict) -> ServeConfig:
    """Defaults, then the YAML file at `path` (if any), then `overrides` (nested dicts merged)."""
    data: dict = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: top level must be a mapping")
        data = loaded
    return ServeConfig.model_validate(_merge(data, overrides))


def _merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
