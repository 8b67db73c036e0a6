"""KV transports, one package per transport holding both halves, as vLLM's
``nixl_connector.py`` and SGLang's ``disaggregation/mooncake/`` do: the prefill side's
connector (what sends, or offers, a request's KV) beside the decode side's receiver or
transfer backend (what takes it into the decode's cache).

    pool          the cluster KV pool over gRPC and the node's shared-memory arena
    torch_pair    a torch.distributed pair between one prefill and one decode (--kv-transfer torch)
    mooncake      Mooncake's Transfer Engine (--kv-transfer mooncake)
    layer_stream  layer-wise streaming through the prefill node's store (--kv-streaming layer)

The pieces every transport shares stay where they were: in :mod:`kvstore.transfer` the
receiver base, destinations, wire codec, runs, peers and the backend registry (base, dest,
wire, runs, peers, registry); in :mod:`kvstore.connector` the connector registry (its
``__init__``), the build context, MultiConnector and the decode's FetchConnector (context,
multi, fetch). These ``__init__`` modules import nothing, so naming a transport's package
pulls in neither torch nor mooncake.
"""
