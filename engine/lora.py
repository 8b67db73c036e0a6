"""LoRA adapters (Hu et al. 2021, "LoRA", §4.1: h = W0 x + (alpha / r) B A x), served as vLLM
serves them (`--enable-lora --lora-modules NAME=PATH ...`): every adapter is loaded from its
PEFT directory (`adapter_config.json`, `adapter_model.safetensors`) when the engine starts,
and a request runs with one by naming it as its `model` (SamplingParams.lora_name).

Each adapted linear of the model is wrapped (`LoRALinear`): a step whose batch holds LoRA
requests adds, per adapter in the batch, (x[rows] A^T) B^T to those rows' outputs, before
RoPE or the activation where the base layer fuses them; a step without any runs the base
layers untouched (fused kernels, the CPU decode stack, CUDA graphs). A merged projection
(q|k|v, gate|up; engine.parallel) stacks each part's A along the rank and places its B
block-diagonally, so one pair of GEMMs serves every part. The scale alpha / r (alpha /
sqrt(r) with rsLoRA) is folded into B.

Tensor parallel (vLLM's split, Megatron's layers): a column-parallel layer's rank holds A whole
and its rows of each part's B; a row-parallel layer's rank holds its columns of A and B whole,
and adds its partial update before the all-reduce, which sums them.

Targets: the dense layers' linears (q/k/v/o, gate/up/down projections and the other
LinearBase layers of a family), matched by their checkpoint names. Refused with
AdapterError: DoRA, trained biases, `modules_to_save`, per-module rank or alpha patterns,
pickled weights (`adapter_model.bin`), a rank above `--max-lora-rank`, and a target this
engine cannot adapt (MoE experts, embeddings, lm_head).
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from pdcluster import kernels
from pdcluster.engine.forward_context import get_forward_context
from pdcluster.engine.parallel import LinearBase, MergedColumnParallelLinear, RowParallelLinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT's prefix of every tensor name in an adapter file
_PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter directory that cannot be served (see the module docstring)."""


class UnknownAdapterError(ValueError):
    """A request names an adapter the engine did not load."""


@dataclass(frozen=True)
class _Factors:
    """One adapter's A [r, in] and scaled B [out, r] for one checkpoint module."""

    a: torch.Tensor
    b: torch.Tensor


class LoRALinear(nn.Module):
    """A LinearBase (`base`) plus every adapter's low-rank update: `lora_a` [adapters, R, in],
    `lora_b` [adapters, out, R] (R: the parts' ranks side by side, zero where an adapter is
    shorter or does not target a part). Attributes it does not have are the base layer's."""

    def __init__(self, base: LinearBase, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer("lora_b", lora_b, persistent=False)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if not isinstance(base, RowParallelLinear) or not get_forward_context().lora:
            return self._add(x, base(x))
        y = base.tp.all_reduce(self._add(x, base.gemm(x, None)))  # the ranks' partial updates
        return y if base.bias is None else y + base.bias

    def forward_rope(self, x: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
        """As MergedColumnParallelLinear.forward_rope, the update added before the rotation."""
        if not get_forward_context().lora:
            return self.base.forward_rope(x, positions, cos_sin_cache, head_dim)
        sizes = self.base.local_sizes
        return kernels.rotary_embedding_qk(positions, self.forward(x), cos_sin_cache,
                                           sizes[0], sizes[1], head_dim)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """As MergedColumnParallelLinear.forward_silu_and_mul, the update added before the
        activation."""
        if not get_forward_context().lora:
            return self.base.forward_silu_and_mul(x)
        return kernels.silu_and_mul(self.forward(x))

    def _add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for slot, rows in get_forward_context().lora:
            shrunk = x.index_select(0, rows) @ self.lora_a[slot].t()
            y.index_add_(0, rows, shrunk @ self.lora_b[slot].t())
        return y


class LoRAAdapters:
    """The adapters an engine serves, by name; `slot(name)` is the index its wrapped layers
    hold it at."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._slots = {name: i for i, name in enumerate(names)}

    def slot(self, name: str) -> int:
        """Raises UnknownAdapterError for a name not loaded."""
        try:
            return self._slots[name]
        except KeyError:
            raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded; loaded: "
                                      f"{', '.join(self.names)}") from None


def load_adapters(modules: dict[str, str], model: nn.Module, max_rank: int) -> LoRAAdapters:
    """Reads each adapter (name -> PEFT directory) and wraps the model's linears that any of
    them targets in LoRALinear, in place, in the model's dtype and device, with this rank's
    shard of each factor. Call after the base weights are loaded and packed. Raises
    AdapterError (see the module docstring)."""
    targets = _targets(model)
    adapters = [_read(name, pathlib.Path(path), max_rank, model, targets)
                for name, path in modules.items()]
    weight = next(model.parameters())
    by_module: dict[str, list[tuple[int, int, _Factors]]] = {}
    for slot, factors in enumerate(adapters):
        for checkpoint_name, f in factors.items():
            module_name, part = targets[checkpoint_name]
            by_module.setdefault(module_name, []).append((slot, part, f))
    for module_name, entries in by_module.items():
        base = model.get_submodule(module_name)
        parts = _parts(base)
        rank = max(f.a.shape[0] for _, _, f in entries)
        a = torch.zeros(len(adapters), rank * len(parts), base.in_features)
        b = torch.zeros(len(adapters), sum(parts), rank * len(parts))
        for slot, part, f in entries:
            fa, fb = _shard(base, part, f)
            r, row = fa.shape[0], sum(parts[:part])
            a[slot, part * rank:part * rank + r] = fa
            b[slot, row:row + parts[part], part * rank:part * rank + r] = fb
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child,
                LoRALinear(base, a.to(weight.device, weight.dtype),
                           b.to(weight.device, weight.dtype)))
    return LoRAAdapters(list(modules))


def _shard(base: LinearBase, part: int, f: _Factors) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of whole factors: a row-parallel layer's columns of A; a
    column-parallel one's rows of B within each block of rows its weight splits (Phi-3's
    stacked q|k|v: each of q, k, v)."""
    tp = base.tp
    if tp.world_size == 1:
        return f.a, f.b
    if isinstance(base, RowParallelLinear):
        n = base.in_features
        return f.a[:, tp.rank * n:(tp.rank + 1) * n], f.b
    blocks = _blocks(base, part)
    rows, start = [], 0
    for n in blocks:
        rows.append(f.b[start + tp.rank * n:start + (tp.rank + 1) * n])
        start += n * tp.world_size
    return f.a, torch.cat(rows)


def _blocks(base: LinearBase, part: int) -> list[int]:
    """The rank's row counts of the blocks a part's whole B splits into, one per block."""
    if isinstance(base, MergedColumnParallelLinear):
        return list(base.local_sizes) if base.stacked_in_checkpoint else [base.local_sizes[part]]
    return [base.out_features]


def _parts(base: LinearBase) -> list[int]:
    """The output sizes of a linear's adaptable parts: a merged projection's parts, unless the
    checkpoint stacks them in one module (Phi-3), else the whole output."""
    if isinstance(base, MergedColumnParallelLinear) and not base.stacked_in_checkpoint:
        return list(base.local_sizes)
    return [base.out_features]


def _targets(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Checkpoint module name -> (the model's linear, its part): a merged projection's parts
    are its checkpoint sources (q_proj, k_proj, v_proj beside it)."""
    targets: dict[str, tuple[str, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, MergedColumnParallelLinear) and not module.stacked_in_checkpoint:
            parent = name.rpartition(".")[0]
            for part, source in enumerate(module.sources):
                targets[f"{parent}.{source}"] = (name, part)
        elif isinstance(module, LinearBase):
            targets[name] = (name, 0)
    return targets


def _read(name: str, directory: pathlib.Path, max_rank: int, model: nn.Module,
          targets: dict[str, tuple[str, int]]) -> dict[str, _Factors]:
    """Adapter `name`'s factors by checkpoint module name, checked against the model."""
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"LoRA adapter {name!r}: cannot read {directory / ADAPTER_CONFIG}: "
                           f"{exc}") from exc
    unsupported = [key for key, neutral in (("use_dora", False), ("bias", "none"),
                                            ("modules_to_save", None), ("rank_pattern", {}),
                                            ("alpha_pattern", {}), ("fan_in_fan_out", False))
                   if config.get(key) not in (neutral, None)]
    if unsupported:
        raise AdapterError(f"LoRA adapter {name!r} sets {', '.join(unsupported)}, which this "
                           "engine does not serve")
    rank = int(config.get("r") or 0)
    alpha = float(config.get("lora_alpha") or rank)
    if not 0 < rank <= max_rank:
        raise AdapterError(f"LoRA adapter {name!r} has rank {rank}; --max-lora-rank is "
                           f"{max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: no {ADAPTER_WEIGHTS} in {directory} "
                           "(pickled .bin weights are not read)")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), "pt") as f:
        for key in f.keys():
            stem, _, kind = key.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                raise AdapterError(f"LoRA adapter {name!r}: unexpected tensor {key}; only "
                                   "lora_A and lora_B weights of linears are served")
            pairs.setdefault(model.checkpoint_name(stem), {})[kind[0]] = f.get_tensor(key).float()
    factors: dict[str, _Factors] = {}
    for stem, pair in pairs.items():
        if stem not in targets:
            raise AdapterError(f"LoRA adapter {name!r} targets {stem}, which this engine "
                               "cannot adapt (MoE experts, embeddings and lm_head are not)")
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: {stem} lacks lora_A or lora_B")
        module_name, part = targets[stem]
        base = model.get_submodule(module_name)
        k = base.tp.world_size
        row_parallel = isinstance(base, RowParallelLinear)
        whole_in = base.in_features * (k if row_parallel else 1)
        whole_out = _parts(base)[part] * (1 if row_parallel else k)
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, whole_in) or b.shape != (whole_out, rank):
            raise AdapterError(f"LoRA adapter {name!r}: {stem} has A {tuple(a.shape)} and B "
                               f"{tuple(b.shape)}; the model needs ({rank}, {whole_in}) and "
                               f"({whole_out}, {rank})")
        factors[stem] = _Factors(a, b * scale)
    return factors
