"""The pool transport: KV through the cluster KV pool, the node stores' G2 arena and G3 SSD,
reached over gRPC (another node's store) or the node's shared-memory arena (the same node).
Connector half, what a worker's engine runs against the pool: ``connector`` (PoolConnector, a
prefill's prefix loads and saves of computed blocks; PoolLoadConnector, a decode's loads of a
prefix it computes itself) and ``publish`` (PublishConnector, a decode's saves of finished
sequences). Receiver half, the decode's pull of a prefilled request's blocks from the prefill
node's store: ``grpc_backend`` (GrpcTransferBackend and GrpcKVReceiver, ``--kv-transfer grpc``)
and ``arena_receiver`` (ArenaReceiver, the same pull through the arena on the prefill's own
node). Docstring only: importing the package imports nothing.
"""
