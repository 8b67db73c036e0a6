"""Tensor parallelism in one place: the TP group and the parallel linears.

A TP instance of size k is k processes in one torch.distributed default group. Only this
module touches the default group: a failed collective leaves a gloo group unusable, so the
instance restarts as a whole (engine.tp_instance) rather than repairing its group. TP=1 is
the same code: `TPGroup()` has world_size 1 and every collective is a no-op, so no process
group is ever created.

Megatron-LM's split (Shoeybi et al. 2019, §3), as nano-vllm and vLLM do it:

    qkv_proj, gate_up_proj     MergedColumnParallel  weight rows  [r*n/k : (r+1)*n/k]  (heads)
                               Linear                of each part (q, k, v; gate, up)
    o_proj, down_proj          RowParallelLinear     weight cols  [r*n/k : (r+1)*n/k], then
                                                     all-reduce (sum), then the bias once
    embed_tokens, lm_head, norms                     replicated (small next to the layers here;
                                                     no vocab-parallel split)

so one forward issues exactly 2 all-reduces per decoder layer (`TPGroup.num_all_reduces`).
Each parallel layer has a `weight_loader(param, loaded)` that copies the rank's shard of its
weight or bias (a method of the layer, not a parameter attribute: materializing a meta-device
model replaces the Parameter objects); `loaded` is a safetensors slice
(`safe_open(...).get_slice(name)`), so a rank reads only its shard from disk and never
materializes the full tensor.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pdcluster import kernels
from pdcluster.engine.loader import WeightLoadError


class TPError(RuntimeError):
    """A collective of the TP group failed (a rank died or timed out); the instance is unusable
    and must restart as a whole (a gloo group cannot be rejoined)."""


class TPGroup:
    """The tensor-parallel group of this process: rank, world size and the collectives.

    world_size 1 (the default): every collective is a no-op or the identity. world_size k:
    the torch.distributed default group, which `init_tp_group` formed.

    Attributes:
        num_all_reduces: all-reduces issued so far (a test counts 2 per layer per forward).
    """

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        if world_size > 1 and not (dist.is_initialized() and dist.get_world_size() == world_size):
            raise ValueError(f"TPGroup of {world_size} needs an initialized default group of "
                             "that size (init_tp_group)")
        self.rank = rank
        self.world_size = world_size
        self.num_all_reduces = 0

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules and samples; the other ranks follow its commands."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place; x itself at world size 1."""
        if self.world_size > 1:
            self.num_all_reduces += 1
            self._run(dist.all_reduce, x)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """x of rank 0 into every rank's x (same shape and dtype on all ranks), in place."""
        if self.world_size > 1:
            self._run(dist.broadcast, x, src=0)
        return x

    def scatter(self, out: torch.Tensor, chunks: list[torch.Tensor] | None) -> torch.Tensor:
        """Rank r receives rank 0's chunks[r] into out (chunks: rank 0 only, contiguous)."""
        if self.world_size > 1:
            self._run(dist.scatter, out, chunks if self.is_driver else None, src=0)
        elif chunks is not None:
            out.copy_(chunks[0])
        return out

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x, in rank order, on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return [x]
        out = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        self._run(dist.gather, x, out, dst=0)
        return out

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """(start, end) of this rank's equal part of `size`; ValueError if k does not divide it."""
        if size % self.world_size:
            raise ValueError(f"{what} {size} is not divisible by the tensor parallel size "
                             f"{self.world_size}")
        n = size // self.world_size
        return self.rank * n, (self.rank + 1) * n

    def _run(self, op: Callable, *args: Any, **kwargs: Any) -> None:
        try:
            op(*args, **kwargs)
        except (RuntimeError, ValueError) as exc:  # gloo: "Connection closed by peer", timeouts
            raise TPError(f"TP rank {self.rank}: {op.__name__} failed: {exc}") from exc


def tp_backend(device: str | torch.device) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def create_master_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCPStore on a free port of `host` (its `.port`); never waits for the others."""
    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


#: The group's collective timeout. Ranks 1..k-1 wait in a broadcast for rank 0's next command
#: for as long as the instance is idle, so it must not fire then; a dead peer is noticed at
#: once instead, by its closed connections (and by Ray, engine.tp_instance).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)


def init_tp_group(rank: int, world_size: int, host: str, port: int, device: str,
                  timeout_s: float = 120.0, store: dist.TCPStore | None = None) -> TPGroup:
    """Join the default group of a TP instance at rank 0's store host:port (rank 0 passes the
    store it created with create_master_store). Blocks until all `world_size` ranks joined.
    Raises TPError when they do not within `timeout_s`."""
    if world_size == 1:
        return TPGroup()
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    try:
        dist.init_process_group(tp_backend(device), store=store, rank=rank,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    except (RuntimeError, ValueError) as exc:
        raise TPError(f"TP rank {rank}/{world_size} could not join {host}:{port}: {exc}") from exc
    return TPGroup(rank, world_size)


# ---- loading -------------------------------------------------------------------------------

def _copy(param: torch.Tensor, part: torch.Tensor, name: str) -> None:
    if tuple(part.shape) != tuple(param.shape):
        raise WeightLoadError(f"{name}: checkpoint shape {tuple(part.shape)} != model "
                              f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(part)


def replicated_weight_loader(param: nn.Parameter, loaded: Any, name: str = "") -> None:
    """The whole tensor on every rank (norms, embeddings, lm_head)."""
    _copy(param, loaded[:], name)


def load_shard(param: nn.Parameter, loaded: Any, name: str, dim: int, tp: TPGroup) -> None:
    """This rank's equal part of `loaded` along `dim` (0: rows, 1: columns) into `param`."""
    full = tuple(loaded.get_shape())
    if len(full) <= dim or full[dim] != param.shape[dim] * tp.world_size:
        raise WeightLoadError(f"{name}: checkpoint shape {full} does not split into "
                              f"{tp.world_size} x {tuple(param.shape)} along dim {dim}")
    start, end = tp.rank * param.shape[dim], (tp.rank + 1) * param.shape[dim]
    _copy(param, loaded[start:end] if dim == 0 else loaded[:, start:end], name)


# ---- layers --------------------------------------------------------------------------------

class LinearBase(nn.Module):
    """What every linear layer shares (vLLM's LinearBase): `weight` [out, in] (this rank's
    shard), repacked after loading for the device's fastest GEMM."""

    weight: nn.Parameter
    #: names a packed weight inside a compiled graph (kernels.linear_handle); None: dense
    weight_handle: int | None = None
    #: the weight packed for decode batches on CPU (kernels.pack_skinny_weight), or None
    skinny_weight: torch.Tensor | None = None
    #: this rank's output features (set once the weight is packed) and input features
    out_features: int = 0
    in_features: int = 0

    def process_weights_after_loading(self) -> None:
        """Replace `weight` with `kernels.pack_linear_weight`'s layout (on CPU an opaque oneDNN
        tensor that only `kernels.linear` reads), beside its skinny copy for decode batches;
        call once, after every weight is loaded."""
        dense = self.weight.detach()
        self.skinny_weight = kernels.pack_skinny_weight(dense)
        self.weight = nn.Parameter(kernels.pack_linear_weight(dense), requires_grad=False)
        self.weight_handle = kernels.linear_handle(self.weight, self.skinny_weight)
        self.out_features = int(self.weight.shape[0])

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [n, in] @ weight^T (+ bias) -> [n, out]; a graph torch.compile traces reaches a
        packed weight through its handle, since the opaque tensor cannot be traced."""
        if self.weight_handle is not None and torch.compiler.is_compiling():
            return kernels.linear_by_handle(x, self.weight_handle, self.out_features, bias)
        return kernels.linear(x, self.weight, bias, self.skinny_weight)


class ColumnParallelLinear(LinearBase):
    """y_r = x W_r^T + b_r: this rank's out_features/k outputs (weight rows, bias split).

    x [n, in_features] replicated -> [n, out_features / k]. No communication.
    Raises ValueError if k does not divide out_features.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        start, end = tp.shard(out_features, "output size")
        self.weight = nn.Parameter(torch.empty(end - start, in_features))
        self.bias = nn.Parameter(torch.empty(end - start)) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Any, name: str = "") -> None:
        """Rows [r*n/k, (r+1)*n/k) of the full weight or bias."""
        load_shard(param, loaded, name, 0, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one weight (vLLM's
    MergedColumnParallelLinear / QKVParallelLinear): q|k|v, or gate|up, so one GEMM reads x
    once. Rank r holds its rows of each part, back to back: [sum(part sizes) / k, in_features].

    x [n, in_features] replicated -> [n, sum(part_sizes) / k]; `split` cuts the output into
    the parts. `sources`: the checkpoint's sibling modules whose weights the parts are, in
    order (("q_proj", "k_proj", "v_proj")). Raises ValueError if k does not divide every part
    size, or sources and part sizes differ in number.
    """

    def __init__(self, in_features: int, part_sizes: Sequence[int], bias: bool,
                 tp: TPGroup, sources: Sequence[str]) -> None:
        if len(sources) != len(part_sizes):
            raise ValueError(f"{len(part_sizes)} parts named by {len(sources)} sources")
        local_sizes = [end - start for start, end in (tp.shard(size, "output size")
                                                      for size in part_sizes)]
        super().__init__(in_features, sum(part_sizes), bias, tp)
        self.local_sizes = local_sizes
        self.sources = tuple(sources)

    #: the checkpoint holds the parts as one tensor under this module's own name, part after
    #: part (Phi-3's qkv_proj and gate_up_proj), not one tensor per source
    stacked_in_checkpoint = False

    def checkpoint_tensors(self, module_name: str) -> dict[str, Callable[[Any], None]]:
        """`<parent>.<source>.<weight|bias>` of each part -> its loader (engine.models.base);
        `<module>.<weight|bias>` -> the loader of every part when stacked in the checkpoint."""
        if self.stacked_in_checkpoint:
            return {f"{module_name}.{param_name}":
                    (lambda loaded, param=param, name=f"{module_name}.{param_name}":
                     self._load_stacked(param, loaded, name))
                    for param_name, param in self.named_parameters(recurse=False)}
        parent = module_name.rsplit(".", 1)[0]
        return {f"{parent}.{source}.{param_name}":
                (lambda loaded, param=param, part=part, name=f"{parent}.{source}.{param_name}":
                 self.weight_loader(param, loaded, name, part))
                for param_name, param in self.named_parameters(recurse=False)
                for part, source in enumerate(self.sources)}

    def weight_loader(self, param: nn.Parameter, loaded: Any, name: str = "",
                      part: int = 0) -> None:
        """Rows [r*n/k, (r+1)*n/k) of part `part`'s full weight or bias (n: that part's size)
        into that part's rows of `param`."""
        offset = sum(self.local_sizes[:part])
        load_shard(param.narrow(0, offset, self.local_sizes[part]), loaded, name, 0, self.tp)

    def _load_stacked(self, param: nn.Parameter, loaded: Any, name: str) -> None:
        """This rank's rows of each part of a stacked checkpoint tensor [sum(part sizes),
        ...] into that part's rows of `param`. Raises WeightLoadError for another size."""
        k, rank = self.tp.world_size, self.tp.rank
        rows = tuple(loaded.get_shape())[0]
        if rows != sum(self.local_sizes) * k:
            raise WeightLoadError(f"{name}: checkpoint has {rows} rows, the parts "
                                  f"{[n * k for n in self.local_sizes]} add up to "
                                  f"{sum(self.local_sizes) * k}")
        start = offset = 0
        for local in self.local_sizes:
            begin = start + rank * local
            _copy(param.narrow(0, offset, local), loaded[begin:begin + local], name)
            start, offset = start + local * k, offset + local

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts of an output [n, sum / k] as views [n, part / k] each."""
        return y.split(self.local_sizes, dim=-1)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gate | up projection: x [n, in_features] -> [n, part / k].
        Eager, the tile GEMM applies it as it writes the product (kernels.linear_silu_and_mul);
        a traced graph leaves the activation to Inductor's fusion."""
        if self.weight_handle is not None and torch.compiler.is_compiling():
            return kernels.silu_and_mul(self.gemm(x, self.bias))
        return kernels.linear_silu_and_mul(x, self.weight, self.bias, self.skinny_weight)

    def forward_rope(self, x: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
        """A q | k | v projection with rotate-half RoPE applied to q and k (the first two
        parts, heads of `head_dim`) at `positions` [n]: x [n, in_features] -> [n, sum / k].
        Eager, the tile GEMM rotates as it writes the product (kernels.linear_qk_rope); a
        traced graph rotates the output in place, which Inductor fuses."""
        q_size, k_size = self.local_sizes[0], self.local_sizes[1]
        if self.weight_handle is not None and torch.compiler.is_compiling():
            return kernels.rotary_embedding_qk(positions, self.gemm(x, self.bias), cos_sin_cache,
                                               q_size, k_size, head_dim)
        return kernels.linear_qk_rope(x, self.weight, self.bias, self.skinny_weight, positions,
                                      cos_sin_cache, q_size, k_size, head_dim)


class RowParallelLinear(LinearBase):
    """y = all_reduce(x_r W_r^T) + b: this rank's in_features/k inputs (weight columns); the
    bias (replicated) is added once, after the sum.

    x [n, in_features / k] (a column-parallel output) -> [n, out_features] replicated.
    Raises ValueError if k does not divide in_features.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        start, end = tp.shard(in_features, "input size")
        self.in_features = end - start
        self.weight = nn.Parameter(torch.empty(out_features, end - start))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Any, name: str = "") -> None:
        """Columns [r*n/k, (r+1)*n/k) of the full weight; the whole bias."""
        if param is self.weight:
            load_shard(param, loaded, name, 1, self.tp)
        else:
            replicated_weight_loader(param, loaded, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.gemm(x, None))
        return y if self.bias is None else y + self.bias
