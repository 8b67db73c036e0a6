"""Cost models the Conductor predicts with and the simulator executes with.

Three functions (Mooncake FAST'25 §4, Algorithm 1's Estimate* calls):

    T_prefill(new, cached) = a + b·new + c·new·(cached + new/2)          seconds
        a: fixed cost of a forward; b: per computed token (linear layers); c: attention, each
        new token attends to the cached prefix plus, on average, half of the new tokens.
    T_step(batch, ctx)     = d + e·ctx (+ f·batch)                        seconds
        one decode step of `batch` sequences holding `ctx` context tokens in all.
    T_transfer(bytes)      = latency + bytes / bandwidth                  seconds
        moving KV blocks into an instance's device memory from another tier or node.

T_transfer has one pair of figures per path where they were measured (`transfer_paths`,
written by `pdcluster profile --kv-transfer`): ``local`` (a node's host/SSD tier into a worker's
cache), ``remote`` (a pull from another node's store), ``pd`` (prefill → decode over the
deployment's connector; ``pd:<connector>`` for each one measured), ``pool:<backend>`` (a
pull from a pool backend other than our node stores: ``pool:mooncake-store``, whose blocks
every instance loads as remote ones). A path without figures uses the model's own
`transfer_latency_s` and `transfer_bytes_per_s`.

A deployment predicts with its served model's own bytes per token (`for_kv_bytes_per_token`),
whichever model the figures were measured on.

`BUILTIN_COST_MODELS["mooncake-70b"]` stands for LLaMA-70B on one 8×A800 node, from Mooncake's
reported setup and rates. It was fixed before any policy was tuned; changing a constant needs a
recorded reason (benchmarks/RESULTS.md). `pdcluster profile` fits the same form on the real
engine and writes a JSON file that `serve --cost-model FILE` and `simulate --cost-model FILE`
load (`load_cost_model`).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

KIB = 1024
#: T_transfer's paths (see the module docstring)
PATH_LOCAL, PATH_REMOTE, PATH_PD = "local", "remote", "pd"


@dataclass(frozen=True)
class CostModel:
    """Coefficients of the three cost functions plus the capacities they imply.

    Units: seconds, tokens, bytes. `dram_cache_tokens`: a node's host-DRAM KV cache (G2);
    `decode_kv_tokens`: KV tokens a decode instance's device memory holds. `transfer_paths`:
    path -> {"latency_s", "bytes_per_s"} where measured (module docstring).
    """

    name: str
    prefill_base_s: float
    prefill_per_token_s: float
    prefill_attention_s: float
    step_base_s: float
    step_per_context_token_s: float
    step_per_sequence_s: float
    kv_bytes_per_token: int
    transfer_bytes_per_s: float
    transfer_latency_s: float
    dram_cache_tokens: int
    decode_kv_tokens: int
    source: str = ""
    transfer_paths: dict[str, dict[str, float]] = field(default_factory=dict)
    #: what the figures were measured on: devices per instance (tensor parallel), the model's
    #: weights and the KV-usable memory of one device (0: unknown); `at_tensor_parallel` uses
    #: them
    tensor_parallel_size: int = 1
    weights_bytes: int = 0
    device_memory_bytes: int = 0

    def t_prefill(self, new: int, cached: int = 0) -> float:
        """Seconds to prefill `new` tokens on top of `cached` ones (0 when new <= 0)."""
        if new <= 0:
            return 0.0
        return (self.prefill_base_s + self.prefill_per_token_s * new
                + self.prefill_attention_s * new * (cached + new / 2))

    def t_step(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step (0 for an empty batch)."""
        if batch <= 0:
            return 0.0
        return (self.step_base_s + self.step_per_context_token_s * context_tokens
                + self.step_per_sequence_s * batch)

    def t_transfer(self, num_bytes: float, path: str | None = None) -> float:
        """Seconds to move `num_bytes` of KV over `path` (None or unmeasured: the model's own
        figures; 0 for nothing)."""
        if num_bytes <= 0:
            return 0.0
        figures = self.transfer_paths.get(path) if path else None
        if figures is None:
            return self.transfer_latency_s + num_bytes / self.transfer_bytes_per_s
        return figures["latency_s"] + num_bytes / figures["bytes_per_s"]

    def t_transfer_tokens(self, tokens: int, path: str | None = None) -> float:
        return self.t_transfer(tokens * self.kv_bytes_per_token, path)

    def t_load_tokens(self, local_tokens: int, remote_tokens: int) -> float:
        """Seconds to bring a prefix into a worker's cache: `local_tokens` from its node's
        tiers, `remote_tokens` pulled from other nodes. Without measured local and remote
        figures, one transfer of both at the model's own rate."""
        if PATH_LOCAL not in self.transfer_paths and PATH_REMOTE not in self.transfer_paths:
            return self.t_transfer_tokens(local_tokens + remote_tokens)
        return (self.t_transfer_tokens(local_tokens, PATH_LOCAL)
                + self.t_transfer_tokens(remote_tokens, PATH_REMOTE))

    def for_connector(self, connector: str) -> CostModel:
        """This model with path ``pd`` taken from ``pd:<connector>`` when that was measured."""
        figures = self.transfer_paths.get(f"{PATH_PD}:{connector}")
        if figures is None:
            return self
        return replace(self, transfer_paths={**self.transfer_paths, PATH_PD: figures})

    def for_pool(self, backend: str) -> CostModel:
        """This model with path ``remote`` taken from ``pool:<backend>`` when that was
        measured: with `--kv-pool mooncake-store` every reused block not in an instance's own
        cache is pulled from the store."""
        figures = self.transfer_paths.get(f"pool:{backend}")
        if figures is None:
            return self
        return replace(self, transfer_paths={**self.transfer_paths, PATH_REMOTE: figures})

    def for_kv_bytes_per_token(self, kv_bytes_per_token: int) -> CostModel:
        """This model for a served model that caches `kv_bytes_per_token` bytes per token (its
        real block layout: every KV head, or an MLA latent): T_transfer moves those bytes, and
        the DRAM and decode KV capacities keep their bytes, so they hold other token counts.

        Raises:
            ValueError: kv_bytes_per_token < 1.
        """
        if kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
        if kv_bytes_per_token == self.kv_bytes_per_token:
            return self
        ratio = self.kv_bytes_per_token / kv_bytes_per_token
        return replace(self, kv_bytes_per_token=kv_bytes_per_token,
                       dram_cache_tokens=int(self.dram_cache_tokens * ratio),
                       decode_kv_tokens=int(self.decode_kv_tokens * ratio))

    def with_transfer_paths(self, paths: dict[str, dict[str, float]]) -> CostModel:
        """This model with `paths`' measured figures in place of its own for those paths."""
        return replace(self, transfer_paths={**self.transfer_paths, **paths})

    def at_tensor_parallel(self, tp: int, efficiency: float = 0.85) -> CostModel:
        """This model's instance at tensor parallel `tp` (the planner's TP axis): compute
        times scale by speed(own TP) / speed(tp), speed(t) = t · efficiency^log2(t) (each
        doubling keeps `efficiency` of linear scaling: the all-reduces, Megatron-LM §5.1's
        sub-linear scaling); decode KV room is what `tp` devices hold beyond the weights
        (`device_memory_bytes`, `weights_bytes`), or scales with tp when those are unknown.

        Raises:
            ValueError: tp < 1, or the weights leave no KV room on `tp` devices.
        """
        if tp < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
        if tp == self.tensor_parallel_size:
            return self

        def speed(t: int) -> float:
            return t * efficiency ** math.log2(t)

        k = speed(self.tensor_parallel_size) / speed(tp)
        if self.device_memory_bytes:
            kv_tokens = int((tp * self.device_memory_bytes - self.weights_bytes)
                            // self.kv_bytes_per_token)
        else:
            kv_tokens = self.decode_kv_tokens * tp // self.tensor_parallel_size
        if kv_tokens <= 0:
            raise ValueError(f"{self.name}: {self.weights_bytes / 1e9:.0f} GB of weights leave "
                             f"no KV room on {tp} devices of "
                             f"{self.device_memory_bytes / 1e9:.0f} GB")
        return replace(self, name=f"{self.name}@tp{tp}", tensor_parallel_size=tp,
                       prefill_base_s=self.prefill_base_s * k,
                       prefill_per_token_s=self.prefill_per_token_s * k,
                       prefill_attention_s=self.prefill_attention_s * k,
                       step_base_s=self.step_base_s * k,
                       step_per_context_token_s=self.step_per_context_token_s * k,
                       step_per_sequence_s=self.step_per_sequence_s * k,
                       decode_kv_tokens=kv_tokens)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        """Raises ValueError on a missing or unknown field."""
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        missing = {f.name for f in fields(cls)
                   if f.default is MISSING and f.default_factory is MISSING} - set(data)
        if unknown or missing:
            raise ValueError(f"cost model: unknown fields {sorted(unknown)}, "
                             f"missing {sorted(missing)}")
        for path, figures in data.get("transfer_paths", {}).items():
            if set(figures) != {"latency_s", "bytes_per_s"} or figures["bytes_per_s"] <= 0 \
                    or figures["latency_s"] < 0:
                raise ValueError(f"cost model: transfer path {path!r} needs latency_s >= 0 "
                                 f"and bytes_per_s > 0, got {figures}")
        return cls(**data)


MOONCAKE_70B = CostModel(
    name="mooncake-70b",
    # LLaMA-70B prefill on 8×A800, Mooncake's reported prefill rate: ~1.2 s for 12k new tokens
    prefill_base_s=0.05, prefill_per_token_s=8.3e-5, prefill_attention_s=2.1e-9,
    step_base_s=0.0125, step_per_context_token_s=2.9e-8, step_per_sequence_s=0.0,
    # 80 layers × K,V × 8 KV heads × 128 × fp16 = 320 KiB per token; RDMA at 87 GB/s + 5 ms
    kv_bytes_per_token=320 * KIB, transfer_bytes_per_s=87e9, transfer_latency_s=0.005,
    dram_cache_tokens=3_000_000,
    # (8 × 80 GB × 0.9 − 140 GB of fp16 weights) / 320 KiB ≈ 1.33 M tokens of decode KV
    decode_kv_tokens=1_330_000,
    source="Mooncake FAST'25 setup: LLaMA-70B, one 8×A800 node per instance",
    tensor_parallel_size=8, weights_bytes=140 * 10**9, device_memory_bytes=72 * 10**9,
)

STORIES260K_CPU = CostModel(
    name="stories260k-cpu",
    # `pdcluster profile` of the bundled stories260K (float32, block 16, 1 torch thread) on the
    # 2-core dev VM, 2026-11-20; live calibration (router.policies.live_loads) corrects drift
    prefill_base_s=0.0, prefill_per_token_s=1.93e-5, prefill_attention_s=1.35e-6,
    step_base_s=0.0052, step_per_context_token_s=2.1e-6, step_per_sequence_s=3.6e-5,
    kv_bytes_per_token=1280, transfer_bytes_per_s=7.56e8, transfer_latency_s=0.0,
    dram_cache_tokens=209_715, decode_kv_tokens=16_384,
    source="pdcluster profile, bundled stories260K on a 2-core CPU VM",
)

BUILTIN_COST_MODELS: dict[str, CostModel] = {m.name: m for m in (MOONCAKE_70B, STORIES260K_CPU)}
DEFAULT_COST_MODEL = MOONCAKE_70B.name


def load_cost_model(name_or_path: str) -> CostModel:
    """A built-in model by name, else a JSON file written by `pdcluster profile`.

    Raises:
        ValueError: neither a built-in name nor a readable, valid cost-model file.
    """
    if name_or_path in BUILTIN_COST_MODELS:
        return BUILTIN_COST_MODELS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"cost model {name_or_path!r}: not one of {sorted(BUILTIN_COST_MODELS)} "
                         "and no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"cost model {path}: {exc}") from exc
    return CostModel.from_json(data.get("cost_model", data))


def save_cost_model(model: CostModel, path: str | Path, extra: dict | None = None) -> None:
    """Write `{"cost_model": {...}, **extra}` (extra: fit residuals, samples) as JSON."""
    Path(path).write_text(json.dumps({"cost_model": model.to_json(), **(extra or {})}, indent=2)
                          + "\n", encoding="utf-8")
