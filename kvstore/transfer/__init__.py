"""KV transfer backends: how a decode worker's blocks get from a prefill node into its cache.

A transfer has a deadline and ends in success or a typed error; on
failure the receiver frees what it pre-allocated. One small abstract base
(:mod:`kvstore.transfer.base`) and a registry dict (:mod:`kvstore.transfer.registry`); modelled
on SGLang's ``disaggregation/base/conn.py``. The backends themselves live with their senders,
one package per transport under :mod:`kvstore.transport`; this package keeps what they share:
base, dest, wire, runs, peers and the registry.

Lifecycle of one transfer on the receiving (decode) side, polled once per scheduler step::

    receiver = backend.create_receiver()
    receiver.start(FetchRequest(...), dest)   # dest: pre-allocated blocks; never blocks
    loop: receiver.poll()                     # BOOTSTRAPPING -> TRANSFERRING -> SUCCESS
                                              #                              \\-> FAILED
    SUCCESS: receiver.result() == bytes moved
    FAILED:  receiver.result() raises the typed error (KVTransferError, BlockNotFoundError,
             KVAuthError, BlockLayoutError); no write to dest happens after FAILED is seen,
             so the caller frees the dest blocks at once.

This package's ``__init__`` imports nothing heavy: the KV store server imports
:mod:`kvstore.transfer.runs` and must not pull in torch.
"""
