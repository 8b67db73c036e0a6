"""Decode steps replayed from CUDA graphs (vLLM's full CUDA graphs for uniform decode batches).

On a GPU, a decode step of a model this size is host-bound: every layer's kernels are launched
one by one from Python, and launching them takes longer than running them. So the runner
captures the forward of an all-decode batch once per batch size in `capture_sizes` (1, 2, 4,
then every 8 up to `max_cudagraph_capture_size`, as vLLM's defaults). A decode batch of n
sequences is padded to the smallest captured size N >= n (engine.input_buffers: padding rows
store no K/V and their output is dropped) and its graph is replayed: one launch for the whole
forward and the logits after it (the lm_head and the cast to float32 would otherwise be two
more launches of the host, which the step then waits on).

A graph reads its inputs at the addresses it was captured with: the input buffers' persistent
device tensors, which `InputBuffers.prepare` rewrites in place before each replay. The buffers
are sized for the largest captured batch; when a larger step reallocates them anyway, the
graphs are captured again before the next replay.

What stays off graphs: steps with a prefill chunk (their shapes vary), steps run with the KV
connector's layer hooks (they run Python per layer: a prefill worker's steps), and tensor
parallel instances (their all-reduces go through gloo on the host).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pdcluster.engine.forward_context import ForwardContext, set_forward_context
from pdcluster.engine.input_buffers import InputBuffers
from pdcluster.engine.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Logits = Callable[[torch.Tensor], torch.Tensor]


def capture_sizes(max_size: int) -> tuple[int, ...]:
    """The decode batch sizes captured for `max_size`: 1, 2, 4, then multiples of 8 up to it
    (and `max_size` itself); () for 0."""
    sizes = {s for s in (1, 2, 4) if s <= max_size} | set(range(8, max_size + 1, 8))
    if max_size > 0:
        sizes.add(max_size)
    return tuple(sorted(sizes))


class DecodeGraphs:
    """One captured forward per decode batch size, sharing one memory pool.

    `forward(input_ids, positions)` is the model's forward (compiled or eager) returning hidden
    states [T, hidden]; it runs inside a forward context over `kv_cache` without layer hooks.
    `compute_logits(hidden)` maps them to float32 logits [T, vocab]; the graph holds both.
    """

    def __init__(self, forward: Forward, compute_logits: Logits, inputs: InputBuffers,
                 kv_cache: PagedKVCache, max_size: int) -> None:
        self.sizes = capture_sizes(max_size)
        self._forward, self._inputs, self._kv_cache = forward, inputs, kv_cache
        self._compute_logits = compute_logits
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._generation = -1

    def size_for(self, num_seqs: int) -> int | None:
        """The captured size a decode batch of `num_seqs` pads to, or None above the largest."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (smaller graphs reuse its pool), each after one
        warm-up run of the same inputs (Triton compiles its kernels there, outside capture)."""
        started = time.perf_counter()
        self._graphs.clear()
        pool = None
        for size in sorted(self.sizes, reverse=True):
            input_ids, positions, attn = self._inputs.prepare([], pad_to=size)
            context = ForwardContext(attn, self._kv_cache)
            with set_forward_context(context):
                self._compute_logits(self._forward(input_ids, positions))
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._compute_logits(self._forward(input_ids, positions))
            pool = graph.pool()
            self._graphs[size] = (graph, logits)
        self._generation = self._inputs.generation
        log.info("captured CUDA graphs of decode batches %s in %.1f s", list(self.sizes),
                 time.perf_counter() - started)

    @property
    def stale(self) -> bool:
        """Whether the input buffers were reallocated since the last capture (or none ran):
        capture again before the next replay, before preparing its inputs."""
        return self._inputs.generation != self._generation

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` on what the input buffers hold now (prepared with
        pad_to=size) -> its float32 logits [size, vocab], valid until the next replay.
        Raises RuntimeError if the graphs are stale."""
        if self.stale:
            raise RuntimeError("the input buffers moved since the CUDA graphs were captured")
        graph, logits = self._graphs[size]
        graph.replay()
        return logits
