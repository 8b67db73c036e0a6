"""The layer stream transport (``--kv-streaming layer``; Mooncake FAST'25 §3.1): each layer's
KV goes to the decode while the prefill computes the later layers, as one-shot pieces on the
prefill node's store. Prefill half: ``connector`` (LayerStreamConnector). Decode half and
wire: ``stream`` (LayerStreamAnnounce and plan_pieces, the stream's pieces; LayerStreamSender;
LayerStreamReceiver). Over TE instead of the store, see kvstore.transport.mooncake. Docstring
only: importing the package does not import torch.
"""
