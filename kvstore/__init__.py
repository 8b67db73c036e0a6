"""KV store: block hashing, block pool, tiered node store, gRPC data plane, per-node Ray actor.

Importing ``kvstore`` does not import Ray, gRPC or torch (``kvstore.actor`` imports Ray,
``kvstore.server``/``kvstore.client`` import gRPC).
"""
