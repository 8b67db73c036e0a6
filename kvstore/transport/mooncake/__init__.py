"""The Mooncake transport (``--kv-transfer mooncake``): the decode reads a request's KV out of
memory the prefill registered with Mooncake's Transfer Engine (TE), one-sided. Prefill half:
``connector`` (MooncakeConnector; RegionSource, the registered staging buffer and its leases;
RegionStreamSender, layer streams over TE). Decode half: ``backend`` (MooncakeTransferBackend
and its MooncakeKVReceiver; RemoteRegion) and ``layer_stream`` (MooncakeLayerStreamReceiver).
Both: ``te`` (one Transfer Engine per process, memory registration) and ``te_bind`` with
``te_bind.c`` (TE's listeners confined to the configured address). Docstring only: importing
the package imports neither torch nor the ``mooncake`` wheel.
"""
