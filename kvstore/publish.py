"""How a prefill worker puts its full blocks into its node's pool (G2): straight into the
shared-memory arena when the node's store is a Ray actor beside it, or over gRPC otherwise
(a store in another process without Ray, as in single-process tests)."""

from __future__ import annotations

import abc
from typing import Sequence

import torch

from kvstore.client import KVStoreClient
from kvstore.node_client import NodeStoreClient


class BlockPublisher(abc.ABC):
    @abc.abstractmethod
    def publish(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Store blocks[i] ([n, *block_shape]) under keys[i]; present keys are kept as they are.
        Raises kvstore.errors.KVStoreError subclasses (or Ray errors for a dead store)."""


class ArenaPublisher(BlockPublisher):
    def __init__(self, node_client: NodeStoreClient) -> None:
        self.node_client = node_client

    def publish(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        self.node_client.publish(keys, blocks)


class GrpcPublisher(BlockPublisher):
    def __init__(self, client: KVStoreClient) -> None:
        self.client = client

    def publish(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        self.client.put_blocks(list(keys), blocks)
