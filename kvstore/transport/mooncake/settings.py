"""The Mooncake transport's own settings: ``--kv-transfer mooncake``'s section of the KV
transfer config (KVTransferConfig.kv_connector_extra_config, vLLM's name), validated here."""

from __future__ import annotations

from typing import Literal

import pydantic

from pdcluster.kvstore.config import KVTransferConfig


class MooncakeSettings(pydantic.BaseModel):
    """Attributes:
        protocol: the Transfer Engine's transport, ``tcp`` or ``rdma``
            (``--kv-mooncake-protocol``).
        source_buffer_bytes: host memory a prefill worker registers with TE once, in which
            requests' KV waits for its decode to read it; a request that finds no room is not
            offered over TE (its decode reads the KV store) (``--kv-transfer-buffer-bytes``).
        receive_buffer_bytes: host memory a decode worker keeps registered with TE for staged
            reads (a request whose destination blocks are not consecutive is read in one piece
            into it, then copied into its blocks); a transfer that finds none free registers a
            buffer for itself alone (``--kv-receive-buffer-bytes``).
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    protocol: Literal["tcp", "rdma"] = "tcp"
    source_buffer_bytes: int = pydantic.Field(default=512 << 20, gt=0)
    receive_buffer_bytes: int = pydantic.Field(default=256 << 20, ge=0)

    @classmethod
    def of(cls, transfer: KVTransferConfig) -> MooncakeSettings:
        """``transfer``'s section. Raises pydantic.ValidationError naming a bad key."""
        return cls.model_validate(transfer.kv_connector_extra_config)
