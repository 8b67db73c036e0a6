"""What the engine needs of a checkpoint: `ModelConfig`, parsed from a Hugging Face
`config.json` of a served architecture (engine.models.registry). It accepts both the
transformers<5 keys (`rope_theta`, `rope_scaling` with `type` or `rope_type`) and the
transformers 5 `rope_parameters` dict, a vision-language checkpoint's `text_config`, and the
fields the Hub's configs leave to their transformers config class's defaults.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdcluster.engine.models.registry import UnsupportedArchitectureError, resolve_architecture
from pdcluster.engine.quantization import (QuantizationConfig, UnsupportedQuantizationError,
                                          get_quantization_config)

if TYPE_CHECKING:
    import torch

    from pdcluster.engine.kv_cache_spec import KVCacheSpec

#: model_type -> architecture, for a config.json without `architectures` (as transformers'
#: AutoModelForCausalLM falls back to its model type)
_ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                               "deepseek_v2": "DeepseekV2ForCausalLM",
                               "deepseek_v3": "DeepseekV3ForCausalLM",
                               "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                               "granite": "GraniteForCausalLM",
                               "gemma2": "Gemma2ForCausalLM",
                               "gemma3_text": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                               "olmo3": "Olmo3ForCausalLM",
                               "gemma3": "Gemma3ForConditionalGeneration",
                               "mistral3": "Mistral3ForConditionalGeneration",
                               "llava": "LlavaForConditionalGeneration",
                               "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                               "qwen3_vl": "Qwen3VLForConditionalGeneration"}
#: Qwen2's decoder (q/k/v biases, no o bias) and every Qwen decoder (its sliding-window
#: fields), by model_type, the vision-language checkpoints' text models included
_QWEN2_TYPES = ("qwen2", "qwen2_5_vl", "qwen2_5_vl_text")
_QWEN_TYPES = (*_QWEN2_TYPES, "qwen3", "qwen3_moe", "qwen3_vl_text")
#: model_type -> the MLP activation its checkpoints use (`hidden_activation` or `hidden_act`);
#: every other family's is SwiGLU's silu
_ACTIVATIONS = {"gemma2": "gelu_pytorch_tanh", "gemma3_text": "gelu_pytorch_tanh"}
#: model_type -> the defaults of its transformers config class (Gemma3TextConfig,
#: LlamaConfig, MistralConfig) that the Hub's configs leave out: a vision-language
#: checkpoint's text_config often lists only what differs from them
_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                   "num_hidden_layers": 32, "num_attention_heads": 32,
                   "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
                   "eos_token_id": 2}
_FIELD_DEFAULTS = {"llama": _LLAMA_DEFAULTS,
                   "mistral": {**_LLAMA_DEFAULTS, "intermediate_size": 14336,
                               "num_key_value_heads": 8, "max_position_embeddings": 131_072,
                               "sliding_window": 4096},
                   "gemma3_text": {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "bos_token_id": 2,
    "eos_token_id": 1}}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Fields each scaled rope type needs (transformers' _validate_*_rope_parameters).
_REQUIRED_ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


class ModelConfigError(ValueError):
    """A model directory's config.json is missing, malformed or describes an unsupported model."""


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs of a checkpoint's HF `config.json`: the fields every decoder
    here shares; a family's own fields (experts, norms) its module reads from `hf_config`.

    `architecture` is the served entry of `architectures` (engine.models.registry).

    `rope_scaling` is None for plain RoPE, else a dict holding `rope_type` ("linear" | "llama3" |
    "yarn") and that type's fields (`factor`, ...); `rope_theta` is never inside it. `sliding_rope`:
    (theta, scaling) of the sliding-window layers where they rotate otherwise than the full
    ones (Gemma 3's local base, OLMo 3's unscaled RoPE), else None.
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
    sliding_rope: tuple[float, dict | None] | None = None
    #: the decoder's config.json fields (a multimodal checkpoint's text_config), for the family
    #: module's own
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    #: the checkpoint's quantized format (engine.quantization), None for unquantized weights
    quantization: QuantizationConfig | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path) -> "ModelConfig":
        """Parse `<path>/config.json` (+ extra EOS ids from `generation_config.json`, as vLLM does).

        Raises ModelConfigError for a missing/invalid file, an architecture not served (the
        message names the supported ones), a quantization format or scheme not served
        (`quantization_config`; the message names the supported formats), an
        activation other than the family's (`_ACTIVATIONS`), an unsupported rope type, or
        missing rope scaling fields.
        """
        directory = pathlib.Path(path)
        top = _read_json(directory / "config.json", required=True)
        try:
            architecture = resolve_architecture(top.get("architectures") or [
                _ARCHITECTURE_OF_MODEL_TYPE.get(top.get("model_type"), top.get("model_type"))])
        except UnsupportedArchitectureError as exc:
            raise ModelConfigError(f"{directory}: {exc}") from None
        raw = _decoder_fields(top)
        model_type = raw.get("model_type")
        try:
            quantization = get_quantization_config(
                top.get("quantization_config") or raw.get("quantization_config"))
        except UnsupportedQuantizationError as exc:
            raise ModelConfigError(f"{directory}: {exc}") from None
        key = "hidden_activation" if raw.get("hidden_activation") else "hidden_act"
        act, expected = raw.get(key) or "silu", _ACTIVATIONS.get(model_type, "silu")
        if act != expected:
            raise ModelConfigError(f"{directory}: unsupported {key} {act!r} for {model_type}; "
                                   f"only {expected!r}")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden_size = int(raw["hidden_size"])
            if model_type in _PER_TYPE_ROPE:
                (rope_theta, rope_scaling), sliding_rope = _per_type_ropes(raw, model_type)
            else:
                (rope_theta, rope_scaling), sliding_rope = _parse_rope(raw), None
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
                qkv_bias=True if model_type in _QWEN2_TYPES else attention_bias,
                o_bias=False if model_type in _QWEN2_TYPES else attention_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                layer_windows=_layer_windows(raw, model_type, int(raw["num_hidden_layers"])),
                architecture=architecture,
                kv_latent_dim=(int(raw["kv_lora_rank"]) + int(raw["qk_rope_head_dim"])
                               if raw.get("kv_lora_rank") else 0),
                sliding_rope=sliding_rope,
                hf_config=raw,
                quantization=quantization,
            )
        except KeyError as exc:
            raise ModelConfigError(f"{directory}/config.json: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"{directory}/config.json: invalid value: {exc}") from exc

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """What one block of ``block_size`` tokens caches, all KV heads (TP=1; a rank's share
        is ``.sharded(tp_size)``): K and V of num_key_value_heads x head_dim per layer, split
        by heads across ranks; with MLA one latent of kv_latent_dim every rank holds whole
        (all heads read it)."""
        from pdcluster.engine.kv_cache_spec import KVCacheSpec  # torch, for workers only

        if self.kv_latent_dim:
            return KVCacheSpec.attention(self.num_hidden_layers, block_size, 1,
                                         self.kv_latent_dim, dtype, kv_parts=1)
        return KVCacheSpec.attention(self.num_hidden_layers, block_size,
                                     self.num_key_value_heads, self.head_dim, dtype)

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
    `rope_type` or the legacy `type`, theta from the dict or the top-level `rope_theta`, and
    llama3 and yarn take `original_max_position_embeddings` from the top level, else the dict,
    else `max_position_embeddings`.
    """
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelConfigError(f"rope parameters must be a JSON object, got {params!r}")
    params = dict(params)
    rope_theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or _DEFAULT_ROPE_THETA)
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type == "mrope":  # Qwen2.5-VL's multimodal RoPE: on text, all three axes agree
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelConfigError(f"partial_rotary_factor={partial} is not supported (only full rotary)")
    if rope_type == "default":
        return rope_theta, None
    if rope_type in ("llama3", "yarn"):  # a top-level value first, as transformers reads it
        params["original_max_position_embeddings"] = (
            raw.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or raw.get("max_position_embeddings"))
    missing = [name for name in _REQUIRED_ROPE_FIELDS[rope_type] if params.get(name) is None]
    if missing:
        raise ModelConfigError(f"rope type {rope_type!r} needs fields {missing}")
    return rope_theta, {"rope_type": rope_type, **params}


def _decoder_fields(top: dict[str, Any]) -> dict[str, Any]:
    """The served decoder's fields: the config itself, or a multimodal checkpoint's
    `text_config` (its language model, served alone, as text) with the top level's EOS ids
    and embedding tie, which transformers' composite model follows; under either, the
    family's `_FIELD_DEFAULTS`. Raises ModelConfigError for a text_config
    that is not an object."""
    text = top.get("text_config")
    if text is None:
        return {**_FIELD_DEFAULTS.get(top.get("model_type"), {}), **top}
    if not isinstance(text, dict):
        raise ModelConfigError(f"text_config must be a JSON object, got {text!r}")
    fields = {**_FIELD_DEFAULTS.get(text.get("model_type"), {}), **text}
    for key in ("eos_token_id", "tie_word_embeddings"):  # the whole model's, where it says
        if top.get(key) is not None:
            fields[key] = top[key]
    return fields


#: model_type -> (full layers' default base, sliding layers' default base, the older configs'
#: key of the sliding base) for families whose RoPE differs by layer type (transformers'
#: Gemma3TextConfig and Olmo3Config)
_PER_TYPE_ROPE = {"gemma3_text": (1e6, 1e4, "rope_local_base_freq"),
                  "olmo3": (5e5, 5e5, None)}
#: model_type -> (key, default) of the older configs' period of full-attention layers
_FULL_LAYER_PERIOD = {"gemma2": (None, 2), "gemma3_text": ("sliding_window_pattern", 6),
                      "olmo3": (None, 4)}


def _per_type_ropes(raw: dict[str, Any], model_type: str
                    ) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """(full layers', sliding layers') (theta, scaling), as transformers' config classes read
    them: `rope_parameters` keyed by layer type, or the Hub's older top-level `rope_theta` /
    `rope_scaling` (the full layers') and the family's sliding base (`_PER_TYPE_ROPE`).
    Raises ModelConfigError for a config without `sliding_window` (its sliding layers are
    told apart by their window) or with bidirectional attention (EmbeddingGemma)."""
    if raw.get("sliding_window") is None or raw.get("use_bidirectional_attention"):
        raise ModelConfigError(f"a {model_type} config needs a sliding_window and causal "
                               "attention")
    full_base, sliding_base, sliding_key = _PER_TYPE_ROPE[model_type]
    nested = raw.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        full = dict(nested.get("full_attention") or {})
        local = dict(nested.get("sliding_attention") or {})
    else:
        full = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta")}
        local = {"rope_theta": raw.get(sliding_key) if sliding_key else None}
    full["rope_theta"] = full.get("rope_theta") or full_base
    local["rope_theta"] = local.get("rope_theta") or sliding_base
    return (_parse_rope({**raw, "rope_parameters": full}),
            _parse_rope({**raw, "rope_parameters": local}))


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
    (transformers' Qwen2Config); Gemma 3's and OLMo 3's configs without `layer_types` have a
    full layer every `_FULL_LAYER_PERIOD`-th."""
    window = raw.get("sliding_window")
    if model_type in (*_QWEN_TYPES, "smollm3") and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return (0,) * num_layers
    window = int(window)
    types = raw.get("layer_types")
    if types is None and model_type in _FULL_LAYER_PERIOD:  # the Hub's older configs
        key, default = _FULL_LAYER_PERIOD[model_type]
        period = int(raw.get(key, default) if key else default)
        types = ["sliding_attention" if (layer + 1) % period else "full_attention"
                 for layer in range(num_layers)]
    if isinstance(types, list) and len(types) == num_layers:
        return tuple(window if kind == "sliding_attention" else 0 for kind in types)
    if model_type in _QWEN_TYPES:
        first = int(raw.get("max_window_layers", 0))
        return tuple(window if layer >= first else 0 for layer in range(num_layers))
    return (window,) * num_layers
