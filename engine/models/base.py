"""What every decoder here shares: the decoder stack over the paged cache, checkpoint loading,
weight repacking, logits, and building a model on the meta device.

Tokens arrive flattened ([num_tokens], several sequences packed; see engine.attention), so every
module works on [num_tokens, ...] tensors. Module and parameter names mirror transformers', so
a checkpoint's tensor names find their parameters; where a module stacks several of the
checkpoint's (q|k|v into qkv_proj, gate|up into gate_up_proj, every expert of a layer into one
tensor), the module says which names it reads (`checkpoint_tensors`), as vLLM's stacked
parameter mappings do.

A family (engine.models.<family>) subclasses `DecoderForCausalLM` and builds each layer's
attention and MLP (or the whole layer); norms, embeddings and lm_head are these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pdcluster import kernels
from pdcluster.engine.loader import CheckpointReader, WeightLoadError
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.parallel import LinearBase, TPGroup, replicated_weight_loader
from pdcluster.engine.rope import RotaryEmbedding

#: checkpoint tensor name -> a call that copies the tensor's slice into its parameter
Sources = dict[str, Callable[[Any], None]]


class RMSNorm(nn.Module):
    """RMSNorm with optional fused residual add (kernels.rms_norm); returns (out, residual)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately (vLLM's fused add+norm style).
    `self_attn(hidden, rope)` and `mlp(hidden)` are the family's."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF prefix `model.`)."""

    def __init__(self, config: ModelConfig, layers: list[DecoderLayer]) -> None:
        super().__init__()
        # _weight: no random init (build_model loads every parameter; init on the meta device
        # would cost seconds of one-time imports per process)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LMHead(nn.Module):
    """The untied output projection's weight [vocab, hidden], replicated on every rank."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))


class DecoderForCausalLM(nn.Module):
    """A decoder-only LM (this rank's shard of it). forward -> final hidden states
    (replicated); compute_logits -> float32 logits. A family overrides `build_attention` and
    `build_mlp`, and `tp_split_sizes` for what else tensor parallel splits.

    Raises ValueError if tp's size does not divide what the family splits across ranks."""

    #: whether engine.cpu_decode_stack may run this family's decode steps (its C++ layers are
    #: Llama's)
    runs_cpu_decode_stack = False
    #: checkpoint name fragment -> this module's (vLLM's WeightsMapper), for families whose
    #: HF layer names differ from their modules'
    checkpoint_renames: dict[str, str] = {}
    #: name prefixes (after renaming) of checkpoint tensors this module does not read (a
    #: multimodal checkpoint's vision tower, where only its language model is served)
    checkpoint_ignored: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup()
        type(self).check_tensor_parallel(config, self.tp.world_size)
        self.config = config
        self.model = DecoderModel(config, [self.build_layer(config, self.tp, layer)
                                           for layer in range(config.num_hidden_layers)])
        self.lm_head: LMHead | None = None
        if not config.tie_word_embeddings:
            self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        #: the sliding-window layers' own RoPE (ModelConfig.sliding_rope), or None
        self.sliding_rotary = (RotaryEmbedding(config.head_dim, *config.sliding_rope,
                                               config.max_position_embeddings)
                               if config.sliding_rope else None)
        self._sliding_layers = [window > 0 for window in config.layer_windows] or \
            [False] * config.num_hidden_layers
        #: lm_head's weight as compute_logits reads it (process_weights_after_loading)
        self.logits_weight: torch.Tensor | None = None
        #: its skinny copy for decode batches on CPU (kernels.pack_skinny_weight), or None
        self.logits_skinny: torch.Tensor | None = None

    def build_layer(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        """Decoder layer `layer`: Llama's pre-norm block over the family's attention and MLP
        (a family with another block overrides this and `forward`)."""
        return DecoderLayer(config, self.build_attention(config, tp, layer),
                            self.build_mlp(config, tp, layer))

    def build_attention(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        raise NotImplementedError

    def build_mlp(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def tp_split_sizes(cls, config: ModelConfig) -> dict[str, int]:
        """What tensor parallel splits across ranks, by name: heads, KV heads (never
        replicated) and the MLP's intermediate size."""
        return {"num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads,
                "intermediate_size": config.intermediate_size}

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, tp_size: int) -> None:
        """Raise ValueError unless `tp_size` divides every size in `tp_split_sizes`."""
        if tp_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {tp_size}")
        for what, size in cls.tp_split_sizes(config).items():
            if size % tp_size:
                raise ValueError(f"tensor parallel size {tp_size} does not divide the model's "
                                 f"{what} {size} ({config.name}); KV heads are never replicated "
                                 "across ranks")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: int64 [num_tokens] -> final-normed hidden [num_tokens, hidden].

        Runs inside a forward context (engine.forward_context): writes each layer's new K/V
        into its cache at the context's `attn.slot_mapping`; a sliding-window layer rotates by
        `sliding_rotary` where the model has one. Raises RuntimeError outside one."""
        rope = (positions, self.rotary.cos_sin_cache(positions.device))  # kernels.rotary_embedding's inputs
        sliding_rope = rope if self.sliding_rotary is None else \
            (positions, self.sliding_rotary.cos_sin_cache(positions.device))
        hidden, residual = self.embed(input_ids), None
        for layer, sliding in zip(self.model.layers, self._sliding_layers):
            hidden, residual = layer(hidden, residual, sliding_rope if sliding else rope)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 [num_tokens] -> the embeddings [num_tokens, hidden] the first layer reads."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab] (lm_head, or the embedding if tied)."""
        weight = self.logits_weight
        if weight is None:
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return kernels.linear(hidden, weight, skinny=self.logits_skinny).to(torch.float32)

    def process_weights_after_loading(self) -> None:
        """Repack every GEMM weight for the device's fastest linear (`kernels.pack_linear_weight`,
        vLLM's hook of the same name); call once, after `load_checkpoint`. A tied lm_head gets
        a packed copy of the embedding table (the lookup needs it dense); an untied one is
        packed in place. Each also gets its skinny copy for decode batches, where it applies."""
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.process_weights_after_loading()
        dense = (self.model.embed_tokens.weight if self.lm_head is None
                 else self.lm_head.weight).detach()
        self.logits_skinny = kernels.pack_skinny_weight(dense)
        if self.lm_head is None:
            self.logits_weight = kernels.pack_linear_weight(dense)
        else:
            self.lm_head.weight = nn.Parameter(kernels.pack_linear_weight(dense),
                                               requires_grad=False)
            self.logits_weight = self.lm_head.weight

    def load_checkpoint(self, reader: CheckpointReader) -> None:
        """Copy HF-named tensors (`model.layers.N.self_attn.q_proj.weight`, ...) from lazy
        safetensors slices into the parameters: each parameter's weight_loader reads only this
        rank's rows or columns from disk (engine.parallel), cast to the parameter's dtype and
        device; a stacking module's parts land where it says (`checkpoint_tensors`).
        `lm_head.weight` is ignored when embeddings are tied; rotary `inv_freq` buffers some
        checkpoints carry are ignored, and so are the family's `checkpoint_ignored`.
        Raises WeightLoadError for a missing parameter, a shape mismatch or an unexpected name.
        """
        sources = self.checkpoint_sources()
        names = {self.checkpoint_name(name): name for name in reader.names()}
        unexpected = sorted(
            name
            for name in names
            if name not in sources
            and not name.endswith("rotary_emb.inv_freq")
            and not (name == "lm_head.weight" and self.lm_head is None)
            and not name.startswith(self.checkpoint_ignored)
        )
        if unexpected:
            raise WeightLoadError(f"checkpoint has tensors the model does not: {unexpected[:5]}")
        missing = sorted(name for name in sources if name not in names)
        if missing:
            raise WeightLoadError(f"checkpoint lacks tensors: {missing[:5]} ({len(missing)} in all)")
        for name, load in sources.items():
            load(reader.slice(names[name]))

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's (or module's) name as this module names it
        (`checkpoint_renames` applied)."""
        for old, new in self.checkpoint_renames.items():
            name = name.replace(old, new)
        return name

    def checkpoint_sources(self) -> Sources:
        """Checkpoint tensor name (after `checkpoint_renames`) -> the call loading it."""
        sources: Sources = {}
        for module_name, module in self.named_modules():
            own = getattr(module, "checkpoint_tensors", None)
            if own is not None:
                sources.update(own(module_name))
                continue
            loader = getattr(module, "weight_loader", replicated_weight_loader)
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                sources[name] = (lambda loaded, param=param, name=name, loader=loader:
                                 loader(param, loaded, name))
        return sources


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError unless `tp_size` divides what the model's family splits across ranks
    (its class's `check_tensor_parallel`)."""
    from pdcluster.engine.models.registry import model_class

    model_class(config.architecture).check_tensor_parallel(config, tp_size)


def build_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                tp: TPGroup | None = None) -> DecoderForCausalLM:
    """An uninitialized model of the config's architecture (this rank's shard, with `tp`) with
    parameters allocated in `dtype` on `device`, in eval mode.

    Built on the meta device then materialized, so no time goes into random init; call
    `load_checkpoint` before use."""
    from pdcluster.engine.models.registry import model_class

    with torch.device("meta"):
        model = model_class(config.architecture)(config, tp)
    _materialize(model, dtype, torch.device(device))
    return model.eval().requires_grad_(False)


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter and buffer with an uninitialized tensor on `device`,
    floating ones in `dtype`; a tensor shared between modules stays shared.

    ``Module.to_empty(...).to(dtype)`` would do the same, but it allocates each floating
    tensor twice where `dtype` is not the default, and its ``empty_like`` of a meta tensor goes
    through torch's Python references, whose first use imports sympy, a large import that
    an eager worker does not otherwise need at start."""
    made: dict[int, torch.Tensor] = {}  # id of a meta tensor -> its replacement

    def replace(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, device=device,
                              dtype=dtype if t.is_floating_point() else t.dtype)
            made[id(t)] = nn.Parameter(new, requires_grad=False) if parameter else new
        return made[id(t)]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = replace(param, True)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = replace(buffer, False)
