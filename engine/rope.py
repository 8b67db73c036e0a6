"""Rotary position embedding (RoPE): inverse frequencies and cos/sin tables (applied by
`kernels.rotary_embedding`).

Follows the Hugging Face convention ("rotate half", `cos`/`sin` of width head_dim made of the
half-width frequencies repeated twice), i.e. transformers' `LlamaRotaryEmbedding` and
`apply_rotary_pos_emb`; the inverse frequencies match transformers' `ROPE_INIT_FUNCTIONS`
(`default` = `LlamaRotaryEmbedding.compute_default_rope_parameters`). Reference: Su et al.,
"RoFormer" (2021); Llama 3.1 scaling from Meta's reference `apply_scaling`; YaRN from Peng et
al., "YaRN" (2023).
"""

from __future__ import annotations

import math

import torch

from pdcluster.engine.model_config import SUPPORTED_ROPE_TYPES, ModelConfigError


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), i in [0, d/2), after the checkpoint's scaling.

    `rope_scaling`: None (plain RoPE) or a dict with `rope_type` in {"default", "linear",
    "llama3"} and that type's fields (as in `ModelConfig.rope_scaling`).
    Returns float32 [head_dim // 2] on CPU.
    Raises ModelConfigError for an unsupported rope type.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, rope_scaling)
    if rope_type == "yarn":
        return _yarn_scale(inv_freq, head_dim, rope_theta, rope_scaling)
    raise ModelConfigError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling (matches transformers' _compute_llama3_parameters).

    Wavelengths shorter than original_len / high_freq_factor are kept; longer than
    original_len / low_freq_factor are divided by `factor`; in between, a linear blend of the two
    in (original_len / wavelength).
    """
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original_len / low
    short_wave = wavelen < original_len / high
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~long_wave & ~short_wave, blended, scaled)


def _yarn_scale(inv_freq: torch.Tensor, head_dim: int, rope_theta: float,
                scaling: dict) -> torch.Tensor:
    """YaRN's "NTK-by-parts" blend (Peng et al. 2023, §3.2; transformers'
    _compute_yarn_parameters): dimensions that turn more than `beta_fast` times over the
    original context keep their frequency, those that turn fewer than `beta_slow` times are
    divided by `factor`, and a linear ramp between (bounds floored and ceiled unless
    `truncate` is false)."""
    factor, original_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:
        return (head_dim * math.log(original_len / (rotations * 2 * math.pi))
                / (2 * math.log(rope_theta)))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def attention_factor(rope_scaling: dict | None) -> float:
    """What the cos/sin table is multiplied by (transformers' `attention_scaling`): YaRN's
    `attention_factor`, else 0.1 ln(factor) + 1, or with DeepSeek's `mscale` and
    `mscale_all_dim` the ratio of those two terms; 1.0 for every other rope type."""
    scaling = rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = (scaling["factor"], scaling.get("mscale"),
                                      scaling.get("mscale_all_dim"))
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(factor) + 1 for a factor above 1, else 1 (YaRN §3.4, DeepSeek's
    `yarn_get_mscale`)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_position: int,
                       scale: float = 1.0) -> torch.Tensor:
    """cos | sin table for positions 0..max_position-1, the layout `kernels.rotary_embedding` reads.

    inv_freq: float32 [head_dim // 2]. Returns float32 [max_position, head_dim]: row p is
    cos(p * inv_freq) then sin(p * inv_freq), times `scale` (`attention_factor`), computed in
    float32 like transformers' LlamaRotaryEmbedding.forward.
    """
    positions = torch.arange(max_position, dtype=torch.int64, device=inv_freq.device).to(torch.float32)
    freqs = positions[:, None] * inv_freq.to(torch.float32)[None, :]
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return table if scale == 1.0 else table * scale


class RotaryEmbedding:
    """Per-model RoPE state: the cos | sin table for every position, kept on the device used."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None, max_position: int) -> None:
        self.inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)
        self._cos_sin_cache = rope_cos_sin_cache(self.inv_freq, max_position,
                                                 attention_factor(rope_scaling))

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """float32 [max_position, head_dim] (cos | sin halves) on `device`."""
        if self._cos_sin_cache.device != device:
            self._cos_sin_cache = self._cos_sin_cache.to(device)
        return self._cos_sin_cache
