"""KV store: block hashing, block pool, tiered node store, gRPC data plane, per-node Ray actor.

Light re-exports only; importing ``kvstore`` does not import Ray, gRPC or torch
(``kvstore.actor`` imports Ray, ``kvstore.server``/``kvstore.client`` import gRPC).
"""

from kvstore.config import KVStoreConfig
from kvstore.errors import (BlockLayoutError, BlockNotFoundError, KVAuthError, KVStoreError,
                            KVTransferError, StoreCapacityError)
from kvstore.hashing import block_keys, make_namespace

__all__ = [
    "BlockLayoutError", "BlockNotFoundError", "KVAuthError", "KVStoreConfig", "KVStoreError",
    "KVTransferError", "StoreCapacityError", "block_keys", "make_namespace",
]
