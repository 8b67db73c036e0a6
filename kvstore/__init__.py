"""KV store: the cluster's KV pool (tiered node store, global index, gRPC data plane, per-node
Ray actor) and the KV connectors that move blocks between it, the workers and each other.

Importing ``kvstore`` does not import Ray, gRPC or torch (``kvstore.actor`` imports Ray,
``kvstore.server``/``kvstore.client`` import gRPC).
"""
