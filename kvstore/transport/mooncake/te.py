"""Mooncake's Transfer Engine (TE) as pdcluster runs it, for both ends of
``--kv-transfer mooncake`` and the Mooncake Store client: one initialized engine per process
with P2P handshakes (no metadata server), its listeners confined to the configured address
(kvstore.transport.mooncake.te_bind), its timeout, the session name peers reach it at, and memory
registration.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdcluster.kvstore.config import KVTransferConfig
from pdcluster.kvstore.errors import KVTransferError
from pdcluster.kvstore.transport.mooncake.settings import MooncakeSettings
from pdcluster.kvstore.transport.mooncake.te_bind import confine_listeners

if TYPE_CHECKING:  # registration takes tensors; nothing else here needs torch
    import torch

#: TE's own floor for MC_TRANSFER_TIMEOUT (it ignores less).
_TE_MIN_TIMEOUT_S = 5
#: What TE's async submit returns for a batch it did not start (0 now; -1 as unsigned before).
TE_NO_BATCH = (0, 2**64 - 1)
#: The error a worker raises when the optional extra is not installed.
TE_MISSING = ("--kv-transfer mooncake needs Mooncake's Transfer Engine: pip install "
              "'pdcluster[mooncake]' (or [mooncake-cuda]), and the OS package libibverbs1")


def new_transfer_engine(config: KVTransferConfig):
    """An initialized TE on ``config.bind_host`` with P2P handshakes (no metadata server), over
    its MooncakeSettings.protocol; its listeners bind ``config.bind_host`` only
    (kvstore.transport.mooncake.te_bind) and its transfers time out after ``config.timeout_s``.

    Raises:
        KVTransferError: the ``mooncake`` package is missing (``pdcluster[mooncake]``), the
            listeners cannot be confined, or TE failed to initialize.
    """
    # TE logs through glog at MC_LOG_LEVEL (INFO by default: a line per segment it opens)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # the optional extra
        raise KVTransferError(TE_MISSING) from exc
    confine_listeners(config.bind_host)
    # read by TransferEngine's constructor: its sync calls give up after this long
    os.environ["MC_TRANSFER_TIMEOUT"] = str(te_timeout_s(config))
    engine = TransferEngine()
    host = advertised_host(config.bind_host)
    protocol = MooncakeSettings.of(config).protocol
    if engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
        raise KVTransferError(f"Mooncake TransferEngine failed to initialize on {host} over "
                              f"{protocol}")
    return engine


def te_timeout_s(config: KVTransferConfig) -> int:
    """TE's timeout for ``config``: ``timeout_s`` rounded up, at least TE's own floor."""
    return max(_TE_MIN_TIMEOUT_S, math.ceil(config.timeout_s))


def advertised_host(bind_host: str) -> str:
    """The address peers reach a TE bound to ``bind_host`` at: itself, or for a wildcard
    (0.0.0.0, ::: every interface, as across nodes) this node's Ray IP, as a KV store does."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    import ray.util

    return ray.util.get_node_ip_address()


def session_of(engine, bind_host: str) -> str:
    """The TE session name peers use to reach ``engine``: ``host:rpc_port``."""
    return f"{advertised_host(bind_host)}:{engine.get_rpc_port()}"


def register(engine, tensors: Sequence[torch.Tensor]) -> None:
    """Register each contiguous tensor's memory with ``engine``. Raises KVTransferError."""
    for tensor in tensors:
        if engine.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size()):
            raise KVTransferError("Mooncake register_memory failed")
