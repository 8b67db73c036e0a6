"""ModelRunner: turns a batch of sequence chunks into one paged forward pass and logits.

A chunk is the next slice of one sequence: a whole prompt, one piece of a chunked prefill (its
earlier pieces, or a reused cached prefix, already in the cache), or the single token of a
decode step. Any mix can share one `execute` call. The caller (a worker's scheduler) owns block
allocation; the runner only checks that each block table covers the chunk.

Tensor parallel (engine.parallel): the runner of rank 0 (the driver) is the one a worker's
engine calls; every call is a command that the other ranks' runners, looping in `follow()`,
run in the same order. A command is an int64 header broadcast from rank 0, then its tensors —
never `broadcast_object_list` (it pickles):

    STEP   header [1, T, S, B, max_seq_len]; one int64 payload of 3T + S*B + 2S + 1:
           input_ids[T] | positions[T] | slot_mapping[T] | block_tables[S*B] | seq_lens[S] |
           query_start_loc[S+1]; every rank runs the forward (2 all-reduces per layer),
           rank 0 alone computes logits (lm_head is replicated)
    WRITE  header [2, n]; block ids[n]; then a scatter: rank r gets its KV-head slice of the
           n full blocks rank 0 holds (the KV pool's layout has every head, as at TP=1); a
           latent cache (MLA), which every rank holds whole, gets the blocks broadcast
    READ   header [3, n]; block ids[n]; then a gather: rank 0 gets every rank's head slice
           and concatenates them into full blocks (a latent cache: rank 0 reads its own, no
           command)
    STOP   header [4]: follow() returns

Each step's inputs are written into persistent buffers (engine.input_buffers) and the forward
runs inside a forward context (engine.forward_context) that carries the attention metadata, the
cache and the KV connector's layer hooks; the forward is compiled (engine.compilation) unless
the config runs it eager. On CUDA, a compiled runner at TP=1 replays decode steps from CUDA
graphs (engine.cuda_graphs).

Rank 0 serializes commands with a lock, so the engine loop's steps and a KV fetch's writes
(from transfer threads) may call it concurrently. At TP=1 there is no command, no lock and no
communication: `wire_kv` is the cache itself.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from pdcluster import kernels
from pdcluster.engine import compilation, cpu_binding, cpu_decode_stack
from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.blocks import num_blocks_for
from pdcluster.engine.core.kv_cache_manager import NULL_BLOCK
from pdcluster.engine.cuda_graphs import DecodeGraphs
from pdcluster.engine.forward_context import ForwardContext, LayerHooks, set_forward_context
from pdcluster.engine.input_buffers import InputBuffers, SequenceChunk
from pdcluster.engine.kv_cache import PagedKVCache
from pdcluster.engine.kv_cache_spec import gather_shards, split_shards
from pdcluster.engine.loader import CheckpointReader
from pdcluster.engine.lora import LoRAAdapters, UnknownAdapterError, load_adapters
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import build_model, check_tensor_parallel
from pdcluster.engine.parallel import TPError, TPGroup
from pdcluster.engine.quantization import check_quantization

__all__ = ["ModelRunner", "SequenceChunk", "ShardedKVView"]

log = logging.getLogger(__name__)

_STEP, _WRITE, _READ, _STOP = 1, 2, 3, 4
_HEADER = 8
#: sequences a step's input buffers hold at first; they grow if a step holds more
_INITIAL_MAX_SEQS = 256


class ModelRunner:
    """Owns the model weights (this rank's shard) and this worker's paged KV cache (this rank's
    KV heads); runs batches of chunks.

    wire_kv: the cache as the KV pool sees it — whole blocks of `kv_cache_spec` (every KV
    head) as uint8 bytes, with read_blocks / write_blocks / block_nbytes / spec / device like
    PagedKVCache. At TP=1 it is `kv_cache` itself; at TP=k a view whose reads gather and
    whose writes scatter each rank's share (rank 0).
    """

    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig | None = None,
                 tp: TPGroup | None = None) -> None:
        """Load config (unless given) and this rank's weights from `engine_config.model`
        (reading only its shard from the safetensors files), allocate the cache.

        tp: this process's TP group, of engine_config.tensor_parallel_size ranks (default: TP=1).
        Raises ModelConfigError / WeightsNotFoundError / WeightLoadError for a bad checkpoint and
        ValueError for a max_model_len beyond the model's limit, or a TP size that does not
        divide the heads, KV heads or intermediate size. Sets torch's intra-op threads
        (process-wide) to `engine_config.torch_threads` and, on CPU, pins them to cores by
        `engine_config.cpu_bind` (engine.cpu_binding): build it on the thread that will run
        the engine's ops. Compiles the forward and warms it up unless `engine_config.eager()`
        (`forward_mode` says which runs; a compile that cannot work falls back to eager with a
        warning).
        """
        self.engine_config = engine_config
        self.model_config = model_config or ModelConfig.from_pretrained(engine_config.model)
        self.max_model_len = engine_config.resolved_max_model_len(self.model_config)
        self.tp = tp or TPGroup()
        if self.tp.world_size != engine_config.tensor_parallel_size:
            raise ValueError(f"TP group of {self.tp.world_size} ranks, engine config says "
                             f"tensor_parallel_size={engine_config.tensor_parallel_size}")
        check_tensor_parallel(self.model_config, self.tp.world_size)
        torch.set_num_threads(engine_config.torch_threads)
        kernels.set_backend(engine_config.kernel_backend)
        self.device = torch.device(engine_config.device)
        #: the cores this engine's torch threads are pinned to (None: unpinned)
        self.cpu_cores = (cpu_binding.bind_threads(engine_config.cpu_bind,
                                                   engine_config.torch_threads)
                          if self.device.type == "cpu" else None)
        dtype = engine_config.torch_dtype()
        kernels.prepare(self.device, dtype)
        self.model = build_model(self.model_config, dtype, self.device, self.tp)
        quantization = self.model_config.quantization
        check_quantization(quantization, engine_config.quantization)
        with CheckpointReader(engine_config.model) as reader:
            self.model.load_checkpoint(
                reader if quantization is None else quantization.checkpoint_source(reader))
        self.model.process_weights_after_loading()
        #: the --lora-modules adapters, their layers wrapped around the model's (engine.lora);
        #: None without any
        self.lora: LoRAAdapters | None = (
            load_adapters(engine_config.lora_modules, self.model, engine_config.max_lora_rank)
            if engine_config.lora_modules else None)
        #: what a block holds, every KV head (the KV pool's unit); this rank caches its share
        self.kv_cache_spec = self.model_config.kv_cache_spec(engine_config.block_size, dtype)
        self.kv_cache = PagedKVCache(self.kv_cache_spec.sharded(self.tp.world_size),
                                     engine_config.num_kv_blocks, self.device,
                                     engine_config.resolved_kv_cache_layout())
        self.wire_kv = self.kv_cache if self.tp.world_size == 1 else ShardedKVView(self)
        self._lock = threading.Lock() if self.tp.world_size > 1 else contextlib.nullcontext()
        self._broken: TPError | None = None
        #: called (on the failing thread) once a collective failed; engine.tp_instance exits
        #: the process there, so the instance restarts as a whole
        self.on_tp_failure: Callable[[TPError], None] | None = None
        #: the KV connector's per-layer hooks, run around each layer's attention (a worker
        #: engine sets its connector here); None: none
        self.layer_hooks: LayerHooks | None = None
        graph_max = engine_config.max_cudagraph_capture_size
        self._inputs = InputBuffers(max(engine_config.max_num_batched_tokens, graph_max),
                                    max(_INITIAL_MAX_SEQS, graph_max),
                                    self.max_model_len, engine_config.block_size, self.device)
        self._step_lock = threading.Lock()  # one step's views of the input buffers at a time
        started = time.perf_counter()
        #: the model's forward as run: compiled (engine.compilation) or the module itself
        self.forward, self.forward_mode = compilation.select_forward(
            self.model, self.device, self.tp.world_size, engine_config.eager(),
            self._warm_up)
        if self.forward_mode == "compiled":
            log.info("model compiled and warmed up in %.1f s", time.perf_counter() - started)
        #: decode steps replayed from CUDA graphs (engine.cuda_graphs); None: every step runs
        #: the forward
        self.decode_graphs: DecodeGraphs | None = None
        if (self.device.type == "cuda" and self.tp.world_size == 1 and not engine_config.eager()
                and graph_max > 0):
            graphs = DecodeGraphs(self.forward, self.model.compute_logits, self._inputs,
                                  self.kv_cache, graph_max)
            try:
                graphs.capture()
                self.decode_graphs = graphs
            except Exception as exc:  # noqa: BLE001 - the forward still runs without graphs
                log.warning("capturing CUDA graphs failed, decode steps run the forward: %s: %s",
                            type(exc).__name__, exc)
        #: on CPU, an eager forward's all-decode steps as one C++ call (engine.cpu_decode_stack);
        #: None: every step runs the forward
        self.cpu_decode_stack: cpu_decode_stack.CPUDecodeStack | None = (
            cpu_decode_stack.build(self.model, self.kv_cache)
            if self.forward_mode == "eager" and self.tp.world_size == 1 else None)

    @torch.inference_mode()
    def execute(self, chunks: list[SequenceChunk], *, all_logits: bool = False) -> torch.Tensor:
        """Run one forward pass over `chunks`, writing their K/V into the cache (rank 0 of a TP
        instance: on every rank).

        Returns float32 logits on the engine device: [len(chunks), vocab] for each chunk's last
        token, or [total new tokens, vocab] in chunk order if `all_logits`.
        Raises ValueError for an empty batch or chunk, a negative num_computed_tokens, a sequence
        longer than max_model_len, or a block table too short or naming a block outside the
        cache (before any rank is told); TPError when the TP group failed.
        """
        if not chunks:
            raise ValueError("execute needs at least one chunk")
        for index, chunk in enumerate(chunks):
            self._validate(index, chunk)
        with self._step_lock:
            lora_slots = self._lora_slots(chunks)
            lora = lora_slots is not None
            graph_size = None if lora else self._graph_size(chunks)
            if graph_size is not None:
                if self.decode_graphs.stale:
                    self.decode_graphs.capture()
                self._inputs.prepare(chunks, pad_to=graph_size)
                # a copy: the graph's output is rewritten by the next replay
                return self.decode_graphs.replay(graph_size)[:len(chunks)].clone()
            input_ids, positions, attn = self._inputs.prepare(chunks)
            if not lora and self._on_decode_stack(chunks):
                return self.model.compute_logits(
                    self.cpu_decode_stack.forward(input_ids, positions, attn))
            with self._command():
                if self.tp.world_size > 1:
                    self._send_step(input_ids, positions, attn, lora_slots)
                hidden = self._run_forward(input_ids, positions, attn, self.layer_hooks,
                                           _lora_rows(lora_slots))
            if not all_logits:
                hidden = hidden[attn.query_start_loc[1:].to(torch.int64) - 1]
            return self.model.compute_logits(hidden)

    def _graph_size(self, chunks: list[SequenceChunk]) -> int | None:
        """The captured batch size this step replays at, or None to run the forward: only
        all-decode steps without layer hooks, up to the largest captured size."""
        if self.decode_graphs is None or self.layer_hooks is not None:
            return None
        if any(len(chunk.token_ids) != 1 for chunk in chunks):
            return None
        return self.decode_graphs.size_for(len(chunks))

    def _on_decode_stack(self, chunks: list[SequenceChunk]) -> bool:
        """Whether this step runs on the CPU decode stack: all-decode, without layer hooks, on
        the kernel backend it was built for, within its rows."""
        stack = self.cpu_decode_stack
        return (stack is not None and self.layer_hooks is None and stack.takes(len(chunks))
                and kernels.get_backend() == "auto"
                and all(len(chunk.token_ids) == 1 for chunk in chunks))

    def _run_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     attn: AttentionMetadata, hooks: LayerHooks | None,
                     lora: tuple[tuple[int, torch.Tensor], ...] = ()) -> torch.Tensor:
        with set_forward_context(ForwardContext(attn, self.kv_cache, hooks, lora)):
            return self.forward(input_ids, positions)

    def lora_slot(self, lora_name: str | None) -> int:
        """The runner's index of adapter `lora_name` (SequenceChunk.lora_slot); -1 for None.
        Raises ValueError for a name not loaded (engine.lora.UnknownAdapterError)."""
        if lora_name is None:
            return -1
        if self.lora is None:
            raise UnknownAdapterError(f"LoRA adapter {lora_name!r} requested, but this engine "
                                      "serves none (--enable-lora --lora-modules)")
        return self.lora.slot(lora_name)

    def _lora_slots(self, chunks: list[SequenceChunk]) -> torch.Tensor | None:
        """Each token's adapter slot (-1: none), int64 [num_tokens] on the device; None when
        no chunk has an adapter."""
        if self.lora is None or all(chunk.lora_slot < 0 for chunk in chunks):
            return None
        return torch.tensor([chunk.lora_slot for chunk in chunks for _ in chunk.token_ids],
                            dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def _warm_up(self, forward: compilation.Forward) -> None:
        """Run `forward` once, through the input buffers, on a few tokens whose K/V are not
        stored (slot -1) and whose attention reads block 0, so compiling happens now, not on a
        first request."""
        num_tokens = 4
        table = [0] * num_blocks_for(num_tokens, self.kv_cache.block_size)
        input_ids, positions, attn = self._inputs.prepare(
            [SequenceChunk([0] * num_tokens, 0, table)])
        attn.slot_mapping.fill_(-1)
        with set_forward_context(ForwardContext(attn, self.kv_cache)):
            forward(input_ids, positions)

    # ---- tensor parallel: rank 0's commands and the other ranks' loop -----------------------
    def read_wire_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Whole blocks (uint8 [n, kv_cache_spec.block_nbytes], every KV head) gathered from
        every rank's share (rank 0 only). Raises ValueError for a bad block id, TPError."""
        index = self.kv_cache.index_of(block_ids)
        with self._command():
            if self.tp.world_size > 1:
                self._send_header(_READ, len(index))
                self.tp.broadcast(index)
            local = self.kv_cache.read_blocks(index.tolist())
            return gather_shards(self.kv_cache_spec, self.tp.gather(local))

    def write_wire_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write whole blocks `data` (uint8 [n, kv_cache_spec.block_nbytes]); each rank keeps
        its share (rank 0 only). Raises ValueError for a bad shape, dtype or block id, TPError."""
        index = self.kv_cache.write_index(block_ids, data, self.kv_cache_spec.block_nbytes)
        with self._command():
            if self.tp.world_size > 1:
                self._send_header(_WRITE, len(index))
                self.tp.broadcast(index)
            shards = split_shards(self.kv_cache_spec, data.to(self.device), self.tp.world_size)
            local = torch.empty((len(index), self.kv_cache.block_nbytes), dtype=torch.uint8,
                                device=self.device)
            self.kv_cache.write_blocks(index.tolist(), self.tp.scatter(local, shards))

    def close(self) -> None:
        """Rank 0, when its engine closes: end the other ranks' follow() loops, so they leave
        the group with it (no-op at TP=1 or once broken)."""
        if self.tp.world_size > 1 and self._broken is None:
            with self._command():
                self._send_header(_STOP)

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks 1..k-1: run rank 0's commands until STOP. Raises TPError when the group fails
        (rank 0 died): this process must then go, since a gloo group cannot be rejoined."""
        if self.tp.is_driver:
            raise RuntimeError("rank 0 drives; only ranks 1..k-1 follow")
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        while True:
            command, *args = self.tp.broadcast(header).tolist()
            if command == _STOP:
                return
            if command == _STEP:
                input_ids, positions, attn, lora_slots = self._receive_step(*args[:5])
                self._run_forward(input_ids, positions, attn, None, _lora_rows(lora_slots))
                continue
            index = self.tp.broadcast(torch.empty(args[0], dtype=torch.int64, device=self.device))
            local = torch.empty((args[0], self.kv_cache.block_nbytes), dtype=torch.uint8,
                                device=self.device)
            if command == _WRITE:
                self.kv_cache.write_blocks(index.tolist(), self.tp.scatter(local, None))
            elif command == _READ:
                self.tp.gather(self.kv_cache.read_blocks(index.tolist()))
            else:
                raise TPError(f"TP rank {self.tp.rank}: unknown command {command}")

    @contextlib.contextmanager
    def _command(self):
        with self._lock:
            if self._broken is not None:
                raise TPError(f"TP instance unusable since: {self._broken}")
            try:
                yield
            except TPError as exc:
                self._broken = exc
                if self.on_tp_failure is not None:
                    self.on_tp_failure(exc)
                raise

    def _send_header(self, command: int, *args: int) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1:1 + len(args)] = command, torch.tensor(args, dtype=torch.int64)
        self.tp.broadcast(header.to(self.device))

    def _send_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   attn: AttentionMetadata, lora_slots: torch.Tensor | None) -> None:
        num_seqs, max_blocks = attn.block_tables.shape
        self._send_header(_STEP, input_ids.shape[0], num_seqs, max_blocks, attn.max_seq_len,
                          int(lora_slots is not None))
        self.tp.broadcast(torch.cat([input_ids, positions, attn.slot_mapping,
                                     attn.block_tables.flatten().to(torch.int64),
                                     attn.seq_lens.to(torch.int64),
                                     attn.query_start_loc.to(torch.int64),
                                     *([] if lora_slots is None else [lora_slots])]))

    def _receive_step(self, num_tokens: int, num_seqs: int, max_blocks: int, max_seq_len: int,
                      has_lora: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                              torch.Tensor | None]:
        sizes = [num_tokens] * 3 + [num_seqs * max_blocks, num_seqs, num_seqs + 1] + \
            [num_tokens] * has_lora
        payload = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        input_ids, positions, slots, tables, seq_lens, starts, *lora_slots = \
            self.tp.broadcast(payload).split(sizes)
        attn = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables.view(num_seqs, max_blocks).to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            query_start_loc=starts.to(torch.int32),
            max_seq_len=max_seq_len,
        )
        return input_ids, positions, attn, lora_slots[0] if lora_slots else None

    def _validate(self, index: int, chunk: SequenceChunk) -> None:
        block_size, num_blocks = self.kv_cache.block_size, self.kv_cache.num_blocks
        seq_len = chunk.num_computed_tokens + len(chunk.token_ids)
        if not chunk.token_ids:
            raise ValueError(f"chunk {index}: token_ids is empty")
        if chunk.num_computed_tokens < 0:
            raise ValueError(f"chunk {index}: num_computed_tokens {chunk.num_computed_tokens} < 0")
        if seq_len > self.max_model_len:
            raise ValueError(
                f"chunk {index}: positions up to {seq_len - 1} exceed max_model_len {self.max_model_len}"
            )
        needed = num_blocks_for(seq_len, block_size)
        if len(chunk.block_table) < needed:
            raise ValueError(
                f"chunk {index}: block_table has {len(chunk.block_table)} blocks, {seq_len} tokens "
                f"need {needed} (block_size {block_size})"
            )
        bad = [b for b in chunk.block_table[:needed] if not 0 <= b < num_blocks
               and b != NULL_BLOCK]
        if bad:
            raise ValueError(f"chunk {index}: block ids {bad[:5]} outside the cache's [0, {num_blocks})")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in chunk.token_ids):
            raise ValueError(f"chunk {index}: token id outside the vocabulary [0, {vocab})")


class ShardedKVView:
    """`ModelRunner.wire_kv` at TP > 1 (rank 0): the sharded cache as whole blocks."""

    def __init__(self, runner: ModelRunner) -> None:
        cache = runner.kv_cache
        self._runner = runner
        self.spec = runner.kv_cache_spec
        self.num_layers, self.num_blocks, self.block_size = (cache.num_layers, cache.num_blocks,
                                                             cache.block_size)
        self.device = cache.device
        self.block_nbytes: int = self.spec.block_nbytes

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        return self._runner.read_wire_blocks(block_ids)

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        self._runner.write_wire_blocks(block_ids, data)


def _lora_rows(slots: torch.Tensor | None) -> tuple[tuple[int, torch.Tensor], ...]:
    """Each token's adapter slot -> (slot, its token rows) per adapter present
    (ForwardContext.lora); () for None."""
    if slots is None:
        return ()
    return tuple((slot, (slots == slot).nonzero().squeeze(1))
                 for slot in slots.unique().tolist() if slot >= 0)
