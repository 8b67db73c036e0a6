"""Chained prefix keys for full KV blocks.

Rule (prefix-hash chaining as in Mooncake FAST'25 §4 and vLLM's
prefix caching):

    key[-1] = 32 zero bytes                      (the parent of block 0)
    key[i]  = sha256(key[i-1] ‖ int32_le(token_ids[i*B:(i+1)*B]) ‖ namespace)

where B is ``block_size``. Only FULL blocks get a key; a partial tail block is never keyed or
indexed (it travels under a per-request handle instead). Because each key covers its parent,
two prompts share key i exactly when they share all tokens of blocks 0..i (and the namespace).

Keys are stable across processes and machines: sha256 only, no Python ``hash()``, no seeds.
The namespace (model identity, LoRA adapter included, + optional per-tenant ``cache_salt``)
keeps tenants, models and adapters from sharing or poisoning each other's cache (vLLM
CVE-2025-25183).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 32
ROOT_PARENT_KEY = bytes(KEY_BYTES)
_NAMESPACE_VERSION = b"pdcluster-kv-ns-v1"
_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1


def _length_prefixed(part: bytes) -> bytes:
    return struct.pack("<Q", len(part)) + part


def make_namespace(model_id: str, cache_salt: str | None = None,
                   lora_name: str | None = None) -> bytes:
    """Namespace bytes that go into every block key.

    Args:
        model_id: model identity (e.g. the checkpoint path or name plus revision).
        cache_salt: optional per-tenant salt; ``None`` and ``""`` are distinct namespaces.
        lora_name: the LoRA adapter the KV was computed with (None: the base model), part of
            the model's identity as vLLM keys it into its block hashes.

    Returns:
        Unambiguous bytes: a version tag, then each part length-prefixed (uint64 LE), with a
        presence flag for the salt and for the adapter, so no two (model_id, cache_salt,
        lora_name) triples collide by concatenation; without an adapter, the same bytes as
        before adapters existed.
    """
    parts = [_length_prefixed(_NAMESPACE_VERSION), _length_prefixed(model_id.encode("utf-8"))]
    for optional in (cache_salt, lora_name):
        if optional is None:
            parts.append(b"\x00")
        else:
            parts.append(b"\x01" + _length_prefixed(optional.encode("utf-8")))
    return b"".join(parts[:-1] if lora_name is None else parts)


def block_keys(token_ids: Sequence[int], block_size: int, namespace: bytes) -> list[bytes]:
    """Chained sha256 keys of the full blocks of ``token_ids``.

    Args:
        token_ids: prompt (or sequence) token ids; each must fit in int32.
        block_size: tokens per block (> 0).
        namespace: from :func:`make_namespace`.

    Returns:
        ``len(token_ids) // block_size`` keys of 32 bytes each; the partial tail gets none.

    Raises:
        ValueError: ``block_size`` <= 0 or a token id outside int32.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    num_full = len(token_ids) // block_size
    block_fmt = f"<{block_size}i"
    keys: list[bytes] = []
    parent = ROOT_PARENT_KEY
    for i in range(num_full):
        block = token_ids[i * block_size : (i + 1) * block_size]
        try:
            packed = struct.pack(block_fmt, *block)
        except struct.error as exc:
            raise ValueError(
                f"token ids of block {i} must be int32 in [{_INT32_MIN}, {_INT32_MAX}]: {exc}"
            ) from exc
        parent = hashlib.sha256(parent + packed + namespace).digest()
        keys.append(parent)
    return keys
