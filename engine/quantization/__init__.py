"""Quantized checkpoints (vLLM's model_executor/layers/quantization): the formats a model
directory may be published in, chosen by its config.json's ``quantization_config``
(``quant_method``) or by ``--quantization`` (vLLM's flag and method names).

A format is a module here and one entry in `QUANTIZATION_METHODS`. What each runs natively
where, and what is refused: docs/quantization.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from pdcluster.engine.quantization.base import QuantizationConfig, UnsupportedQuantizationError

#: vLLM's method name -> "module:class" of its QuantizationConfig
QUANTIZATION_METHODS = {
    "compressed-tensors":
        "pdcluster.engine.quantization.compressed_tensors:CompressedTensorsConfig",
    "fp8": "pdcluster.engine.quantization.fp8:Fp8Config",
}


def get_quantization_config(hf_config: dict[str, Any] | None) -> QuantizationConfig | None:
    """The checkpoint's format from its config.json's ``quantization_config`` (None or empty:
    an unquantized checkpoint). Raises UnsupportedQuantizationError for a method not in
    `QUANTIZATION_METHODS` (the message names it and the supported ones) or a scheme the
    method's config refuses."""
    if not hf_config:
        return None
    if not isinstance(hf_config, dict):
        raise UnsupportedQuantizationError(f"quantization_config must be an object, got "
                                           f"{type(hf_config).__name__}")
    method = str(hf_config.get("quant_method") or "")
    if method not in QUANTIZATION_METHODS:
        raise UnsupportedQuantizationError(
            f"quantization method {method or '(no quant_method)'!r} is not supported; "
            f"supported: {_supported()}")
    module, name = QUANTIZATION_METHODS[method].split(":")
    return getattr(importlib.import_module(module), name).from_config(hf_config)


def check_quantization(config: QuantizationConfig | None, requested: str | None) -> None:
    """``--quantization`` against the checkpoint's format (None: whatever it is). Raises
    UnsupportedQuantizationError for a method not served, one that differs from the
    checkpoint's, or one on an unquantized checkpoint (vLLM quantizes such weights at load;
    not done here)."""
    if requested is None:
        return
    if requested not in QUANTIZATION_METHODS:
        raise UnsupportedQuantizationError(
            f"--quantization {requested!r} is not supported; supported: {_supported()}")
    if config is None:
        raise UnsupportedQuantizationError(
            f"--quantization {requested}: the checkpoint has no quantization_config, and "
            "quantizing an unquantized checkpoint at load is not supported")
    if config.name != requested:
        raise UnsupportedQuantizationError(
            f"--quantization {requested} does not match the checkpoint's {config.name}")


def _supported() -> str:
    return ", ".join(sorted(QUANTIZATION_METHODS))


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "UnsupportedQuantizationError",
           "check_quantization", "get_quantization_config"]
