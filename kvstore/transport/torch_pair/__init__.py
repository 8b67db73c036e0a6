"""The torch pair transport (``--kv-transfer torch``): a prefill pushes a request's KV blocks
to its decode over a two-rank torch.distributed process group of their own (gloo on CPU, NCCL
on CUDA). Prefill half: ``push`` (TorchPushConnector). Decode half: ``backend``
(TorchTransferBackend and its TorchKVReceiver; TorchKVSender, the send loop the push runs).
Both: ``channel`` (TorchPairChannel, the pair's authenticated process group). Docstring only:
importing the package does not import torch.
"""
