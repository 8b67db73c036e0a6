"""Cache events of a worker's G1 block pool; the cluster index is built from them.

A pool appends events as its prefix cache changes and its owner drains them with
``BlockPool.take_events()`` once per engine step, then publishes them to the global index.
Replaying a pool's events in order reproduces the set of keys it holds. Same roles as vLLM v1's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (``vllm/distributed/kv_events.py``).

Keys are the 32-byte chained sha256 block keys of ``engine.core.hashing``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became cached under ``keys`` (in prefix order).

    ``parent_key`` is the key of the block that precedes ``keys[0]`` in its sequence, or ``None``
    when ``keys[0]`` is a sequence's first block. ``keys`` form one chain unless the pool skipped a
    key it already held under another block (see ``BlockPool.cache_full_blocks``).
    """

    keys: tuple[bytes, ...]
    parent_key: bytes | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The pool no longer holds ``keys`` (their blocks were evicted for reuse)."""

    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The pool dropped every key it held (``BlockPool.reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllCleared
