"""Model and engine configuration.

`ModelConfig` is parsed from a Hugging Face `config.json` of a served architecture
(engine.models.registry) and accepts both
the transformers<5 keys (`rope_theta`, `rope_scaling` with `type` or `rope_type`) and the
transformers 5 `rope_parameters` dict. `EngineConfig` is the validated, frozen runtime config of
one worker's engine (paged cache geometry, dtype, device).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import pydantic

from engine import cpu_binding
from engine.models.registry import UnsupportedArchitectureError, resolve_architecture

if TYPE_CHECKING:
    import torch

BUNDLED_MODEL: pathlib.Path = (pathlib.Path(__file__).parent / "models" / "stories260K").resolve()

#: model_type -> architecture, for a config.json without `architectures` (as transformers'
#: AutoModelForCausalLM falls back to its model type)
_ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                               "deepseek_v2": "DeepseekV2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Fields each scaled rope type needs (transformers' _validate_*_rope_parameters).
_REQUIRED_ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


class ModelConfigError(ValueError):
    """A model directory's config.json is missing, malformed or describes an unsupported model."""


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs of a checkpoint's HF `config.json`: the fields every decoder
    here shares; a family's own fields (experts, norms) its module reads from `hf_config`.

    `architecture` is the served entry of `architectures` (engine.models.registry).

    `rope_scaling` is None for plain RoPE, else a dict holding `rope_type` ("linear" | "llama3")
    and that type's fields (`factor`, ...); `rope_theta` is never inside it.
    `qkv_bias`/`o_bias`/`mlp_bias`: which linears carry a bias (Qwen2: q/k/v always; Llama:
    `attention_bias` means q/k/v/o, `mlp_bias` gate/up/down). `layer_windows`: each layer's
    attention window in tokens where the checkpoint uses one (Mistral v0.1, Qwen2 with
    use_sliding_window), else 0.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_type: str
    name: str
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    #: each layer's sliding window in tokens, 0 where it attends to everything (empty: none)
    layer_windows: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    #: MLA (DeepSeek-V2, §2.1): a token's cached entry, the compressed latent (`kv_lora_rank`)
    #: and the decoupled RoPE key (`qk_rope_head_dim`), in place of K and V per head; 0: none
    kv_latent_dim: int = 0
    #: the whole config.json, for the family module's own fields
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path) -> "ModelConfig":
        """Parse `<path>/config.json` (+ extra EOS ids from `generation_config.json`, as vLLM does).

        Raises ModelConfigError for a missing/invalid file, an architecture not served (the
        message names the supported ones), an unsupported `hidden_act` or rope type, or
        missing rope scaling fields.
        """
        directory = pathlib.Path(path)
        raw = _read_json(directory / "config.json", required=True)
        model_type = raw.get("model_type")
        try:
            architecture = resolve_architecture(
                raw.get("architectures") or [_ARCHITECTURE_OF_MODEL_TYPE.get(model_type, model_type)])
        except UnsupportedArchitectureError as exc:
            raise ModelConfigError(f"{directory}: {exc}") from None
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"{directory}: unsupported hidden_act {act!r}; only 'silu' (SwiGLU)")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden_size = int(raw["hidden_size"])
            rope_theta, rope_scaling = _parse_rope(raw)
            generation = _read_json(directory / "generation_config.json", required=False)
            attention_bias = bool(raw.get("attention_bias", False))
            return cls(
                hidden_size=hidden_size,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
                vocab_size=int(raw["vocab_size"]),
                max_position_embeddings=int(raw["max_position_embeddings"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
                model_type=model_type,
                name=directory.resolve().name,
                qkv_bias=True if model_type == "qwen2" else attention_bias,
                o_bias=False if model_type == "qwen2" else attention_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                layer_windows=_layer_windows(raw, model_type, int(raw["num_hidden_layers"])),
                architecture=architecture,
                kv_latent_dim=(int(raw["kv_lora_rank"]) + int(raw["qk_rope_head_dim"])
                               if raw.get("kv_lora_rank") else 0),
                hf_config=raw,
            )
        except KeyError as exc:
            raise ModelConfigError(f"{directory}/config.json: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"{directory}/config.json: invalid value: {exc}") from exc

    def kv_cache_dims(self, tp_size: int = 1) -> tuple[int, int, int]:
        """(parts, heads, head dim) of one token's cache entry on one of `tp_size` ranks:
        (2, num_key_value_heads / tp_size, head_dim), K and V of the rank's KV heads; with
        MLA (1, 1, kv_latent_dim): one latent every rank holds whole (all heads read it)."""
        if self.kv_latent_dim:
            return 1, 1, self.kv_latent_dim
        return 2, self.num_key_value_heads // tp_size, self.head_dim

    @property
    def sliding_window(self) -> int | None:
        """The window of the layers that have one (every such layer has the same), or None."""
        return max(self.layer_windows, default=0) or None

    def kv_window(self) -> int | None:
        """The window every layer has, so that blocks wholly before it are needed by none:
        the KV cache manager's window. None when any layer attends to everything."""
        if not self.layer_windows or min(self.layer_windows) == 0:
            return None
        return max(self.layer_windows)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )


def _read_json(file: pathlib.Path, *, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise ModelConfigError(f"no {file.name} in {file.parent}")
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"cannot read {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{file}: expected a JSON object")
    return data


def _parse_rope(raw: dict[str, Any]) -> tuple[float, dict | None]:
    """Return (rope_theta, normalized rope_scaling) from either key style.

    Mirrors transformers' RotaryEmbeddingConfigMixin.standardize_rope_params: the type comes from
    `rope_type` or the legacy `type`, theta from the dict or the top-level `rope_theta`, and llama3
    defaults `original_max_position_embeddings` to `max_position_embeddings`.
    """
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelConfigError(f"rope parameters must be a JSON object, got {params!r}")
    params = dict(params)
    rope_theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or _DEFAULT_ROPE_THETA)
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelConfigError(f"partial_rotary_factor={partial} is not supported (only full rotary)")
    if rope_type == "default":
        return rope_theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    missing = [name for name in _REQUIRED_ROPE_FIELDS[rope_type] if params.get(name) is None]
    if missing:
        raise ModelConfigError(f"rope type {rope_type!r} needs fields {missing}")
    return rope_theta, {"rope_type": rope_type, **params}


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for token in value if isinstance(value, list) else ([] if value is None else [value]):
            if int(token) not in ids:
                ids.append(int(token))
    return tuple(ids)


def _layer_windows(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window in tokens, 0 for full attention: `layer_types` where the
    config lists them ("sliding_attention"), else Mistral's and Mixtral's `sliding_window` on
    every layer, or Qwen's on layers >= `max_window_layers` when `use_sliding_window`
    (transformers' Qwen2Config)."""
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return (0,) * num_layers
    window = int(window)
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        return tuple(window if kind == "sliding_attention" else 0 for kind in types)
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        first = int(raw.get("max_window_layers", 0))
        return tuple(window if layer >= first else 0 for layer in range(num_layers))
    return (window,) * num_layers


# Rows from which a CPU prefill step is compute-bound (EngineConfig.prefill_compute_bound_tokens).
CPU_COMPUTE_BOUND_TOKENS = 512
# The block pool's run window with a cross-layer cache (EngineConfig.block_run_window): wide
# enough that a request's blocks come in a few runs under churn, narrow enough that prefix hits
# at the capacity of Mooncake's own trace study barely moved (benchmarks/RESULTS.md).
CROSS_LAYER_RUN_WINDOW = 2


class EngineConfig(pydantic.BaseModel):
    """Runtime config of one worker's model engine (frozen).

    `block_size`: tokens per KV block. `num_kv_blocks`: blocks in this worker's paged cache.
    `max_model_len`: longest sequence (prompt + output) in tokens; None means the model's
    `max_position_embeddings`. `torch_threads`: intra-op CPU threads (Ray sets OMP_NUM_THREADS=1).
    `enable_prefix_caching`: reuse cached full blocks of a prompt's prefix (vLLM's flag; off for
    A/B runs). `max_num_batched_tokens`: token budget of one forward step; longer prompts are
    prefilled in chunks of at most this many tokens (vLLM's chunked prefill).
    `prefill_compute_bound_tokens`: a prefill worker's step takes no further prompt once it
    holds this many tokens (engine.core.scheduler.Scheduler.schedule_chunks); None resolves
    per device (resolved_prefill_compute_bound_tokens).
    `preemption_mode`: how a decode worker makes room when its cache is full (vLLM's modes).
    `kernel_backend`: "auto" runs Triton kernels on CUDA tensors and torch references
    elsewhere; "triton" forces Triton (on CPU through TRITON_INTERPRET=1); "torch" forces torch.
    `tensor_parallel_size`: ranks of this engine's TP instance (engine.parallel); the runner
    is given the matching TPGroup. `num_kv_blocks` counts blocks, each rank holding its KV heads.
    In a deployment it is vLLM's `--tensor-parallel-size`, for every instance; `--prefill-tp` /
    `--decode-tp` override it for one role (deploy.config.ServeConfig.prefill_engine).
    `cpu_bind`: the cores a CPU worker pins its torch threads to, one per core
    (engine.cpu_binding): "none" leaves them to the OS scheduler; "auto" claims free cores
    among those the process may run on; a cpu list ("0-3,8") claims among those. Workers of
    one node never share a claimed core. A launcher sets it to the cores it set aside for the
    node's workers; library use (tests, benchmarks) defaults to "none".
    `enforce_eager`: true runs the model's forward eager, false compiles it with torch.compile
    (engine.compilation; vLLM's `--enforce-eager`); None (the default) compiles on CUDA and
    runs eager on CPU, where the C++ kernels already run each layer's ops and the compiled
    forward measured no faster (docs/notes/cpu-engine-findings.md, "The compiled forward").
    `max_cudagraph_capture_size`: on CUDA, a runner that is not eager at TP=1 captures its
    decode forward as CUDA graphs for batches of 1, 2, 4, then every 8 sequences up to this
    (engine.cuda_graphs; vLLM's option of this name); larger decode batches and steps with a
    prefill chunk run the forward. 0 captures none.
    `kv_cache_layout`: how the paged cache holds its layers (engine.kv_cache): "layer" (a
    tensor per layer and K|V) or "cross-layer" (one tensor, every layer of a block together,
    so a KV connector moves a run of blocks in one piece). "auto" (the default) is resolved
    by a deployment from its KV connector, as vLLM's connectors choose
    (deploy.config.ServeConfig.prefill_engine); an engine built directly takes "layer".
    `block_run_window`: how the block pool picks a request's blocks
    (engine.core.block_pool.BlockPool's `run_window`): 0 in LRU order, as vLLM; w >= 1 the longest
    runs of consecutive blocks among the w x n least recently freed. None (the default) is 2
    with a cross-layer cache (a run of its blocks is one Transfer Engine read) and 0 otherwise.
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = str(BUNDLED_MODEL)
    block_size: int = pydantic.Field(16, gt=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: int | None = pydantic.Field(None, gt=0)
    num_kv_blocks: int = pydantic.Field(1024, gt=0)
    device: str = "cpu"
    torch_threads: int = pydantic.Field(1, gt=0)
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = pydantic.Field(512, gt=0)
    prefill_compute_bound_tokens: int | None = pydantic.Field(None, gt=0)
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    kernel_backend: Literal["auto", "triton", "torch"] = "auto"
    tensor_parallel_size: int = pydantic.Field(1, gt=0)
    cpu_bind: str = "none"
    enforce_eager: bool | None = None
    max_cudagraph_capture_size: int = pydantic.Field(256, ge=0)
    kv_cache_layout: Literal["auto", "layer", "cross-layer"] = "auto"
    block_run_window: int | None = pydantic.Field(None, ge=0)

    @pydantic.field_validator("cpu_bind")
    @classmethod
    def _check_cpu_bind(cls, value: str) -> str:
        return cpu_binding.validate_cpu_bind(value)

    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by `dtype`."""
        import torch  # here, not at the top: the gateway reads this config before torch loads

        return getattr(torch, self.dtype)

    def device_type(self) -> str:
        """The type part of `device` ("cuda" of "cuda:1"), as ``torch.device(device).type``."""
        return self.device.split(":", 1)[0]

    def eager(self) -> bool:
        """Whether the forward runs eager: `enforce_eager`, or where it is None, whether the
        device is not CUDA."""
        if self.enforce_eager is not None:
            return self.enforce_eager
        return self.device_type() != "cuda"

    def resolved_kv_cache_layout(self) -> str:
        """`kv_cache_layout`, with "auto" as "layer" (no KV connector prefers otherwise)."""
        return "layer" if self.kv_cache_layout == "auto" else self.kv_cache_layout

    def resolved_block_run_window(self) -> int:
        """`block_run_window`, or where it is None, CROSS_LAYER_RUN_WINDOW with a cross-layer
        cache and 0 (LRU order) with a tensor per layer."""
        if self.block_run_window is not None:
            return self.block_run_window
        return CROSS_LAYER_RUN_WINDOW if self.resolved_kv_cache_layout() == "cross-layer" else 0

    def resolved_prefill_compute_bound_tokens(self) -> int | None:
        """`prefill_compute_bound_tokens`, or where it is None, the device's default.

        On CPU that is CPU_COMPUTE_BOUND_TOKENS: a prefill step of that many tokens is
        compute-bound in fp32 and in bf16, so a second prompt as long in the same step costs
        as much as a step of its own; with half as many, a bf16 step still gains from a
        second prompt (docs/notes/cpu-engine-findings.md, "One prompt per prefill step").
        Elsewhere None (no limit beyond `max_num_batched_tokens`): on a GPU the size at which
        a step is compute-bound depends on the model and the card and has not been measured.
        """
        if self.prefill_compute_bound_tokens is not None:
            return self.prefill_compute_bound_tokens
        if self.device_type() == "cpu":
            return CPU_COMPUTE_BOUND_TOKENS
        return None

    def resolved_max_model_len(self, model_config: ModelConfig) -> int:
        """`max_model_len`, or the model's limit (`max_position_embeddings`) when unset; a
        sliding window does not lower it (windowed attention keeps the last window's keys).
        Raises ValueError if `max_model_len` exceeds that limit.
        """
        limit = model_config.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's limit {limit} "
                f"(max_position_embeddings={model_config.max_position_embeddings})"
            )
        return self.max_model_len
