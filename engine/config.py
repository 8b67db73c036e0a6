"""`EngineConfig`: the validated, frozen runtime config of one worker's engine (paged cache
geometry, dtype, device, scheduling). What the engine reads of the checkpoint itself is
engine.model_config's `ModelConfig`.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Literal

import pydantic

from pdcluster.engine import cpu_binding

if TYPE_CHECKING:
    import torch

    from pdcluster.engine.model_config import ModelConfig

BUNDLED_MODEL: pathlib.Path = (pathlib.Path(__file__).parent / "models" / "stories260K").resolve()

# Rows from which a CPU prefill step is compute-bound (EngineConfig.prefill_compute_bound_tokens).
CPU_COMPUTE_BOUND_TOKENS = 512
# The block pool's run window with a cross-layer cache (EngineConfig.block_run_window): wide
# enough that a request's blocks come in a few runs under churn, narrow enough that prefix hits
# at the capacity of Mooncake's own trace study barely moved (benchmarks/RESULTS.md).
CROSS_LAYER_RUN_WINDOW = 2


class EngineConfig(pydantic.BaseModel):
    """Runtime config of one worker's model engine (frozen).

    `block_size`: tokens per KV block. `num_kv_blocks`: blocks in this worker's paged cache.
    `max_model_len`: longest sequence (prompt + output) in tokens; None means the model's
    `max_position_embeddings`. `torch_threads`: intra-op CPU threads (Ray sets OMP_NUM_THREADS=1).
    `enable_prefix_caching`: reuse cached full blocks of a prompt's prefix (vLLM's flag; off for
    A/B runs). `max_num_batched_tokens`: token budget of one forward step, decode rows and prompt
    chunks together; prompts are prefilled in chunks of what it has left (vLLM's chunked
    prefill). `max_num_seqs`: requests admitted at once, so at most this many decode rows a
    step. Both default to what vLLM's OpenAI server takes on CPU at TP=1 (2,048 and 128; vLLM
    `EngineArgs.get_batch_defaults`).
    `prefill_compute_bound_tokens`: a prefill worker's step takes no further prompt once it
    holds this many tokens (engine.core.scheduler.Scheduler.schedule_chunks); None resolves
    per device (resolved_prefill_compute_bound_tokens).
    `preemption_mode`: how a decode worker makes room when its cache is full (vLLM's modes).
    `scheduling_policy`: "fcfs", or "priority": requests wait, run and are preempted by their
    `priority` first (vLLM's flag; engine.core.scheduler).
    `kernel_backend`: "auto" runs Triton kernels on CUDA tensors and torch references
    elsewhere; "triton" forces Triton (on CPU through TRITON_INTERPRET=1); "torch" forces torch.
    `tensor_parallel_size`: ranks of this engine's TP instance (engine.parallel); the runner
    is given the matching TPGroup. `num_kv_blocks` counts blocks, each rank holding its KV heads.
    In a deployment it is vLLM's `--tensor-parallel-size`, for every instance; `--prefill-tp` /
    `--decode-tp` override it for one role (deploy.config.ServeConfig.prefill_engine).
    `cpu_bind`: the cores a CPU worker pins its torch threads to, one per core
    (engine.cpu_binding): "none" leaves them to the OS scheduler; "auto" claims free cores
    among those the process may run on; a cpu list ("0-3,8") claims among those. Workers of
    one node never share a claimed core. A launcher sets it to the cores it set aside for the
    node's workers; library use (tests, benchmarks) defaults to "none".
    `enforce_eager`: true runs the model's forward eager, false compiles it with torch.compile
    (engine.compilation; vLLM's `--enforce-eager`); None (the default) compiles on CUDA and
    runs eager on CPU, where the C++ kernels already run each layer's ops and the compiled
    forward measured no faster (docs/notes/cpu-engine-findings.md, "The compiled forward").
    `max_cudagraph_capture_size`: on CUDA, a runner that is not eager at TP=1 captures its
    decode forward as CUDA graphs for batches of 1, 2, 4, then every 8 sequences up to this
    (engine.cuda_graphs; vLLM's option of this name); larger decode batches and steps with a
    prefill chunk run the forward. 0 captures none.
    `kv_cache_layout`: how the paged cache holds its layers (engine.kv_cache): "layer" (a
    tensor per layer and K|V) or "cross-layer" (one tensor, every layer of a block together,
    so a KV connector moves a run of blocks in one piece). "auto" (the default) is resolved
    by a deployment from its KV connector, as vLLM's connectors choose
    (deploy.config.ServeConfig.prefill_engine); an engine built directly takes "layer".
    `enable_lora`, `lora_modules` (adapter name -> PEFT directory), `max_lora_rank`: vLLM's
    LoRA flags (engine.lora); a request names an adapter as its model.
    `quantization`: vLLM's `--quantization`, the checkpoint's quantization method
    (engine.quantization); None takes its config.json's `quantization_config`, a name must
    match it.
    `block_run_window`: how the block pool picks a request's blocks
    (engine.core.block_pool.BlockPool's `run_window`): 0 in LRU order, as vLLM; w >= 1 the longest
    runs of consecutive blocks among the w x n least recently freed. None (the default) is 2
    with a cross-layer cache (a run of its blocks is one Transfer Engine read) and 0 otherwise.
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = str(BUNDLED_MODEL)
    block_size: int = pydantic.Field(16, gt=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: int | None = pydantic.Field(None, gt=0)
    num_kv_blocks: int = pydantic.Field(1024, gt=0)
    device: str = "cpu"
    torch_threads: int = pydantic.Field(1, gt=0)
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = pydantic.Field(2048, gt=0)
    max_num_seqs: int = pydantic.Field(128, gt=0)
    prefill_compute_bound_tokens: int | None = pydantic.Field(None, gt=0)
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    kernel_backend: Literal["auto", "triton", "torch"] = "auto"
    tensor_parallel_size: int = pydantic.Field(1, gt=0)
    cpu_bind: str = "none"
    enforce_eager: bool | None = None
    max_cudagraph_capture_size: int = pydantic.Field(256, ge=0)
    kv_cache_layout: Literal["auto", "layer", "cross-layer"] = "auto"
    block_run_window: int | None = pydantic.Field(None, ge=0)
    enable_lora: bool = False
    lora_modules: dict[str, str] = pydantic.Field(default_factory=dict)
    max_lora_rank: int = pydantic.Field(16, gt=0)
    quantization: str | None = None

    @pydantic.model_validator(mode="after")
    def _check_lora(self) -> "EngineConfig":
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        for name in self.lora_modules:
            if not name or name.strip() != name:
                raise ValueError(f"invalid LoRA adapter name {name!r}")
        return self

    @pydantic.field_validator("cpu_bind")
    @classmethod
    def _check_cpu_bind(cls, value: str) -> str:
        return cpu_binding.validate_cpu_bind(value)

    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by `dtype`."""
        import torch  # here, not at the top: the gateway reads this config before torch loads

        return getattr(torch, self.dtype)

    def device_type(self) -> str:
        """The type part of `device` ("cuda" of "cuda:1"), as ``torch.device(device).type``."""
        return self.device.split(":", 1)[0]

    def eager(self) -> bool:
        """Whether the forward runs eager: always with LoRA adapters (their per-step rows are
        not traced), else `enforce_eager`, or where it is None, whether the device is not
        CUDA."""
        if self.lora_modules:
            return True
        if self.enforce_eager is not None:
            return self.enforce_eager
        return self.device_type() != "cuda"

    def resolved_kv_cache_layout(self) -> str:
        """`kv_cache_layout`, with "auto" as "layer" (no KV connector prefers otherwise)."""
        return "layer" if self.kv_cache_layout == "auto" else self.kv_cache_layout

    def resolved_block_run_window(self) -> int:
        """`block_run_window`, or where it is None, CROSS_LAYER_RUN_WINDOW with a cross-layer
        cache and 0 (LRU order) with a tensor per layer."""
        if self.block_run_window is not None:
            return self.block_run_window
        return CROSS_LAYER_RUN_WINDOW if self.resolved_kv_cache_layout() == "cross-layer" else 0

    def resolved_prefill_compute_bound_tokens(self) -> int | None:
        """`prefill_compute_bound_tokens`, or where it is None, the device's default.

        On CPU that is CPU_COMPUTE_BOUND_TOKENS: a prefill step of that many tokens is
        compute-bound in fp32 and in bf16, so a second prompt as long in the same step costs
        as much as a step of its own; with half as many, a bf16 step still gains from a
        second prompt (docs/notes/cpu-engine-findings.md, "One prompt per prefill step").
        Elsewhere None (no limit beyond `max_num_batched_tokens`): on a GPU the size at which
        a step is compute-bound depends on the model and the card and has not been measured.
        """
        if self.prefill_compute_bound_tokens is not None:
            return self.prefill_compute_bound_tokens
        if self.device_type() == "cpu":
            return CPU_COMPUTE_BOUND_TOKENS
        return None

    def resolved_max_model_len(self, model_config: ModelConfig) -> int:
        """`max_model_len`, or the model's limit (`max_position_embeddings`) when unset; a
        sliding window does not lower it (windowed attention keeps the last window's keys).
        Raises ValueError if `max_model_len` exceeds that limit.
        """
        limit = model_config.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's limit {limit} "
                f"(max_position_embeddings={model_config.max_position_embeddings})"
            )
        return self.max_model_len
