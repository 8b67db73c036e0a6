"""compressed-tensors checkpoints, vLLM's method ``compressed-tensors``: what llm-compressor
writes (FP8 and INT8 W8A8, W8A16, W4A16 packed, GPTQ and AWQ exported this way).

The format's own library (``compressed_tensors``) reads the metadata and decompresses: its
``QuantizationConfig`` parses ``quantization_config``, its name matching finds each scheme's
modules (targets, ignore) among the checkpoint's tensor names, and its compressor for the
scheme's format turns a module's stored tensors (``weight`` or ``weight_packed``,
``weight_scale``, ``weight_zero_point``, ``weight_g_idx``, ``weight_shape``) back into the
weight, as its own model-free dequantizer does.

Here that weight is widened to the model's dtype as it is loaded, on every device, and the
activations stay in the model's dtype: a W8A8 or FP8 checkpoint's activation quantization
(``input_activations``) is not applied, and a ``kv_cache_scheme``'s ``k_scale`` / ``v_scale``
go unused while the KV cache is kept in the model's dtype (docs/quantization.md).
"""

from __future__ import annotations

from typing import Any

import torch

from pdcluster.engine.loader import WeightLoadError
from pdcluster.engine.quantization.base import (CheckpointSource, QuantizationConfig,
                                                UnsupportedQuantizationError)

#: the storage formats decompressed here (the library's CompressionFormat values)
SUPPORTED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
#: safetensors dtypes of a weight stored quantized
_QUANTIZED_DTYPES = ("I8", "U8", "I32", "F8_E4M3", "F8_E5M2")


class CompressedTensorsConfig(QuantizationConfig):
    """``quantization_config`` of quant_method ``compressed-tensors``, as the library parses it,
    with each scheme's storage format resolved."""

    name = "compressed-tensors"

    def __init__(self, config: Any) -> None:
        self.config = config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        import pydantic
        from compressed_tensors.compressors.format import infer_module_format
        from compressed_tensors.config import CompressionFormat
        from compressed_tensors.quantization import QuantizationConfig as LibraryConfig

        if config.get("sparsity_config") or config.get("transform_config"):
            raise UnsupportedQuantizationError(
                "compressed-tensors: sparsity and transform configs are not supported")
        try:
            parsed = LibraryConfig.model_validate(config)
        except pydantic.ValidationError as exc:
            raise UnsupportedQuantizationError(
                f"compressed-tensors: quantization_config does not parse: {exc}") from None
        for name, scheme in parsed.config_groups.items():
            fmt = scheme.format or parsed.format
            if fmt is None or CompressionFormat(fmt) is CompressionFormat.mixed_precision:
                fmt = infer_module_format(torch.nn.Linear, scheme)
            fmt = CompressionFormat(fmt)
            if fmt.value not in SUPPORTED_FORMATS:
                raise UnsupportedQuantizationError(
                    f"compressed-tensors: format {fmt.value!r} of {name}; supported: "
                    f"{', '.join(SUPPORTED_FORMATS)}")
            scheme.format = fmt
        return cls(parsed)

    def checkpoint_source(self, reader: CheckpointSource) -> CheckpointSource:
        return CompressedTensorsCheckpoint(reader, self.config)


class CompressedTensorsCheckpoint:
    """A checkpoint's tensors with each compressed module's stored tensors replaced by its
    ``<module>.weight``, decompressed by the library as float32; the format's other tensors
    (activation and KV cache scales) are not among its names.

    Raises WeightLoadError (at construction) for a targeted module that lacks a tensor its
    scheme's compressor needs, naming them.
    """

    def __init__(self, reader: CheckpointSource, config: Any) -> None:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationMetadata
        from compressed_tensors.utils.match import match_quantizable_tensors

        self._reader = reader
        names = reader.names()
        present = dict.fromkeys(names)
        #: module name -> (compressor, scheme, its stored tensors' local names)
        self._modules: dict[str, tuple[Any, Any, tuple[str, ...]]] = {}
        for scheme in config.config_groups.values():
            compressor = BaseCompressor.get_value_from_registry(scheme.format)
            params = tuple(compressor.compression_param_names(scheme))
            for module, _ in match_quantizable_tensors(present, ignore=config.ignore,
                                                       targets=scheme.targets,
                                                       param_targets=[params[0]]):
                # int- and float-quantized keep the name `weight`: a module is quantized where
                # it stores something more (a scale, a shape) or its weight is an integer or
                # float8 one, not where it is an embedding or a norm the name matching takes
                if module in self._modules or not (
                        any(f"{module}.{p}" in present for p in params if p != "weight")
                        or reader.slice(f"{module}.weight").get_dtype() in _QUANTIZED_DTYPES):
                    continue
                missing = [f"{module}.{p}" for p in params if f"{module}.{p}" not in present]
                if missing:
                    raise WeightLoadError(f"compressed-tensors: {module} lacks {missing}")
                self._modules[module] = (compressor, scheme, params)
        qparams = set(QuantizationMetadata.all_qparam_names()) | {"weight_packed", "weight_g_idx"}
        stored = {f"{m}.{p}" for m, (_, _, params) in self._modules.items() for p in params}
        kept = [n for n in names if n not in stored and n.rpartition(".")[2] not in qparams]
        self._names = kept + [f"{m}.weight" for m in self._modules]

    def names(self) -> list[str]:
        return list(self._names)

    def slice(self, name: str) -> Any:
        module, _, param = name.rpartition(".")
        if param != "weight" or module not in self._modules:
            return self._reader.slice(name)
        compressor, scheme, params = self._modules[module]
        stored = {p: self._reader.slice(f"{module}.{p}")[:] for p in params}
        return _Dense(compressor.decompress(stored, scheme)["weight"].to(torch.float32))


class _Dense:
    """A decompressed weight, read as a lazy slice is: ``get_shape()`` and indexing."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self._tensor.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._tensor[index]
