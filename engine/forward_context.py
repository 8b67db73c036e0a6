"""The forward context: what a forward pass's attention layers read besides their inputs.

The paged cache, the batch's attention metadata and the KV connector's per-layer hooks change
meaning every step; passed into a compiled graph as inputs, they would be guarded on (and the
cache might be copied). As in vLLM, the runner sets them per thread around each forward, and
the attention layer's custom op (engine.attention_layer) reads them when the graph runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.kv_cache import PagedKVCache


class LayerHooks(Protocol):
    """The KV connector's per-layer calls (engine.core.kv_connector.KVConnector)."""

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int) -> None: ...


@dataclass(frozen=True)
class ForwardContext:
    """One forward pass's attention metadata, this rank's paged cache, the hooks run around
    each layer's attention (None: none), and the step's LoRA rows: (adapter slot, int64 token
    rows) per adapter in the batch (engine.lora; empty: none)."""

    attn: AttentionMetadata
    kv_cache: PagedKVCache
    layer_hooks: LayerHooks | None = None
    lora: tuple[tuple[int, torch.Tensor], ...] = ()


_local = threading.local()


@contextlib.contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    """`context` is this thread's forward context inside the block (nested blocks restore the
    outer one)."""
    previous = getattr(_local, "context", None)
    _local.context = context
    try:
        yield
    finally:
        _local.context = previous


def get_forward_context() -> ForwardContext:
    """This thread's forward context. Raises RuntimeError outside `set_forward_context`."""
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("no forward context: run the model through ModelRunner, or inside "
                           "pdcluster.engine.forward_context.set_forward_context")
    return context
