"""Every way KV moves between workers: one package per transport holding both halves, as
vLLM's ``nixl_connector.py`` and SGLang's ``disaggregation/mooncake/`` do (the prefill's
connector that sends or offers a request's KV; the decode's source that takes it in), and one
entry per transport in ``registry``.

    pool          the cluster KV pool over gRPC and the node's shared-memory arena; every
                  decode's fallback (--kv-transfer grpc)
    torch_pair    a torch.distributed pair between one prefill and one decode (--kv-transfer torch)
    mooncake      Mooncake's Transfer Engine (--kv-transfer mooncake)
    layer_stream  layer-wise streaming through the prefill node's store (--kv-streaming layer)

What they share: ``base`` (a transfer's poll state, request and receiver; the per-worker
backend), ``source`` (the decode's half as its fetch chain runs it), ``dest`` (where blocks
land), ``wire`` and ``runs`` (the gRPC codec and run grouping), ``peers`` (reaching another
worker over Ray), ``context`` (what connectors are built from), ``multi`` (several connectors
as one), ``fetch`` (the decode's FetchConnector, which runs the chain) and ``registry``.
This ``__init__`` imports nothing, so the KV store server, which imports ``runs``, does not
pull in torch, and naming a transport's package pulls in neither torch nor mooncake.
"""
