"""FP8 checkpoints, vLLM's method ``fp8``: weights in float8 (e4m3) with float32 scales.

Two layouts of scales, told apart by their names and shapes:
- Hugging Face's fine-grained FP8 (``FineGrainedFP8Config``, as DeepSeek-V3 and Qwen3 FP8 are
  published): ``<name>.weight_scale_inv`` holds one scale per ``weight_block_size`` block,
  [ceil(out / bm), ceil(in / bn)] (one block of the whole matrix without a block size);
- vLLM's serialized FP8 (AutoFP8): ``<name>.weight_scale`` per tensor ([] or [1]) or per
  output channel ([out] or [out, 1]), and ``input_scale`` with static activations.
Either way the weight is ``q.float() * scale`` over its block (transformers' Fp8Dequantize,
vLLM's per-tensor dequantization).

Here a weight is widened to the model's dtype as it is loaded, on every device, and the
activations stay in the model's dtype (so a ``static`` checkpoint's ``input_scale`` is not
used): the output is the dequantized checkpoint's, as transformers computes it on a machine
without FP8 math. FP8 matmuls where the hardware has them are not done yet
(docs/quantization.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pdcluster.engine.loader import WeightLoadError
from pdcluster.engine.quantization.base import (CheckpointSource, QuantizationConfig,
                                                UnsupportedQuantizationError)

_SCALE_SUFFIXES = ("_scale_inv", "_scale")


class Fp8Config(QuantizationConfig):
    """``quantization_config`` of quant_method ``fp8``: ``activation_scheme`` dynamic or
    static, ``weight_block_size`` [bm, bn] or None, ``fmt`` e4m3, ``scale_fmt`` float or
    ue8m0 (power-of-two scales, read as they are stored)."""

    name = "fp8"

    def __init__(self, activation_scheme: str = "dynamic",
                 weight_block_size: tuple[int, int] | None = None) -> None:
        self.activation_scheme = activation_scheme
        self.weight_block_size = weight_block_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise UnsupportedQuantizationError(f"fp8: activation_scheme {scheme!r}; supported: "
                                               "dynamic, static")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise UnsupportedQuantizationError(f"fp8: fmt {fmt!r}; supported: e4m3")
        expert_dtype = config.get("expert_dtype", "fp8")
        if expert_dtype != "fp8":
            raise UnsupportedQuantizationError(f"fp8: expert_dtype {expert_dtype!r}; "
                                               "supported: fp8")
        block = config.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and b > 0 for b in block)):
                raise UnsupportedQuantizationError(
                    f"fp8: weight_block_size {block!r}; expected [rows, columns] > 0")
            block = (block[0], block[1])
        return cls(scheme, block)

    def checkpoint_source(self, reader: CheckpointSource) -> CheckpointSource:
        return Fp8Checkpoint(reader, self.weight_block_size)


class Fp8Checkpoint:
    """A checkpoint's tensors with every float8 weight widened to float32 by its scale; the
    scales (and static activations' ``input_scale``) are not among its names.

    Raises WeightLoadError (at construction) for a float8 weight without a scale, or a scale
    whose shape fits neither a tensor, a channel nor ``block`` tiling of its weight.
    """

    def __init__(self, reader: CheckpointSource, block: tuple[int, int] | None) -> None:
        self._reader = reader
        self._block = block
        names = reader.names()
        present = set(names)
        self._scales: dict[str, str] = {}
        hidden = set()
        for name in names:
            if not name.endswith(".weight") or reader.slice(name).get_dtype() != "F8_E4M3":
                continue
            scale = next((name + s for s in _SCALE_SUFFIXES if name + s in present), None)
            if scale is None:
                raise WeightLoadError(f"fp8 weight {name} has no scale ({name}_scale_inv or "
                                      f"{name}_scale) in the checkpoint")
            self._scales[name] = scale
            hidden.add(scale)
            _expand_shape(name, tuple(reader.slice(name).get_shape()),
                          tuple(reader.slice(scale).get_shape()), block)
        hidden |= {n for n in names if n.endswith(".input_scale")}
        self._names = [n for n in names if n not in hidden]

    def names(self) -> list[str]:
        return list(self._names)

    def slice(self, name: str) -> Any:
        scale = self._scales.get(name)
        if scale is None:
            return self._reader.slice(name)
        return _WidenedSlice(name, self._reader.slice(name), self._reader.slice(scale)[:],
                             self._block)


class _WidenedSlice:
    """A float8 weight's lazy slice, read as float32: ``get_shape()``, and basic indexing
    (``[:]``, ``[a:b]``, ``[:, a:b]``) that reads only those bytes of the weight."""

    def __init__(self, name: str, weight: Any, scale: torch.Tensor,
                 block: tuple[int, int] | None) -> None:
        self._name, self._weight, self._block = name, weight, block
        self._scale = scale.to(torch.float32)

    def get_shape(self) -> list[int]:
        return list(self._weight.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        shape = tuple(self._weight.get_shape())
        scale = _expand(self._name, shape, self._scale, self._block)
        return self._weight[index].to(torch.float32) * scale[index]


def _expand_shape(name: str, weight: tuple[int, ...], scale: tuple[int, ...],
                  block: tuple[int, int] | None) -> tuple[int, int]:
    """The (rows, columns) each scale covers. Raises WeightLoadError if `scale` fits no
    layout of `weight` [out, in]."""
    if len(weight) != 2:
        raise WeightLoadError(f"fp8 weight {name}: shape {weight}, expected [out, in]")
    rows, cols = weight
    if math.prod(scale) == 1:
        return rows, cols
    if scale in ((rows,), (rows, 1)):
        return 1, cols
    bm, bn = block or (rows, cols)
    if scale == (-(-rows // bm), -(-cols // bn)):
        return bm, bn
    raise WeightLoadError(f"fp8 weight {name} {weight}: scale shape {scale} fits neither a "
                          f"tensor, a channel nor blocks of {bm} x {bn}")


def _expand(name: str, shape: tuple[int, ...], scale: torch.Tensor,
            block: tuple[int, int] | None) -> torch.Tensor:
    """The scale of every element of a weight of `shape`, [out, in] float32."""
    bm, bn = _expand_shape(name, shape, tuple(scale.shape), block)
    grid = scale.reshape(-(-shape[0] // bm), -(-shape[1] // bn))
    return grid.repeat_interleave(bm, 0)[:shape[0]].repeat_interleave(bn, 1)[:, :shape[1]]
