"""Typed errors of the KV store data plane: a transfer ends in success or one of these, so a
caller can tell a timeout from a missing block from a dead peer. Never raised as bare
``Exception``; gRPC errors never leak to callers."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every KV store error."""


class BlockNotFoundError(KVStoreError):
    """Requested blocks (or a tail handle) are not in the store.

    Attributes:
        missing: the missing block keys (32-byte sha256 keys), empty for a tail miss.
        handle: the missing tail handle, or ``None`` for a keyed-block miss.
    """

    def __init__(self, message: str, missing: list[bytes] | None = None, handle: str | None = None):
        super().__init__(message)
        self.missing: list[bytes] = list(missing or [])
        self.handle: str | None = handle


class KVTransferError(KVStoreError):
    """A transfer failed: deadline exceeded, peer unreachable, or another RPC failure.

    The message names the peer address and the reason.

    Attributes:
        address: ``host:port`` of the peer.
    """

    def __init__(self, message: str, address: str | None = None):
        super().__init__(message)
        self.address = address


class KVTransferTimeout(KVTransferError):
    """A transfer, or one call of it, passed its deadline."""


class KVLoadError(KVStoreError):
    """A request's KV load failed and the KV load failure policy is ``fail``
    (``--kv-load-failure-policy``, vLLM's ``kv_load_failure_policy``): the request ends with
    this error instead of recomputing what did not arrive."""


class KVAuthError(KVStoreError):
    """The KV store refused the call: missing or wrong shared token (gRPC UNAUTHENTICATED).

    The message names the peer address, never the token.

    Attributes:
        address: ``host:port`` of the peer.
    """

    def __init__(self, message: str, address: str | None = None):
        super().__init__(message)
        self.address = address


class BlockLayoutError(KVStoreError):
    """A block's shape, dtype or byte size is unsupported or does not match the others."""


class StoreCapacityError(KVStoreError):
    """A single block (or tail) is larger than the store's whole capacity."""


class StaleArenaError(KVStoreError):
    """A same-node worker named a host arena its KV store no longer has (the store restarted
    with a new one): re-attach (kvstore/node_client.py) and retry.

    Attributes:
        attached: the arena (shared-memory name) the worker is attached to.
        current: the store's arena now.
    """

    def __init__(self, attached: str, current: str):
        super().__init__(f"attached to host arena {attached}, the KV store now has {current}")
        self.attached, self.current = attached, current

    def __reduce__(self):  # rebuilt from its own arguments when it crosses Ray's RPC
        return (type(self), (self.attached, self.current))
