"""What a quantized checkpoint format provides (vLLM's QuantizationConfig)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol


class CheckpointSource(Protocol):
    """What a model's `load_checkpoint` reads (engine.loader.CheckpointReader): tensor names,
    and per name a lazy slice with `get_shape()`, `get_dtype()` (safetensors' name, e.g.
    "F8_E4M3") and basic indexing."""

    def names(self) -> list[str]: ...

    def slice(self, name: str) -> Any: ...


class UnsupportedQuantizationError(ValueError):
    """A checkpoint's or a flag's quantization method or scheme is not served here."""


class QuantizationConfig(ABC):
    """A quantized checkpoint's format, parsed from its ``quantization_config``."""

    #: vLLM's name of the method (``--quantization``)
    name: str

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Parse ``quantization_config``. Raises UnsupportedQuantizationError for a scheme
        this format does not serve."""

    @abstractmethod
    def checkpoint_source(self, reader: CheckpointSource) -> CheckpointSource:
        """The checkpoint as the model loads it: the same tensor names, less the format's own
        (scales), each weight as the model's layers take it. Raises
        engine.loader.WeightLoadError where a weight lacks what the format needs."""
