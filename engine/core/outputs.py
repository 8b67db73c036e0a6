"""What a step's three stages hand each other (vLLM v1's ``SchedulerOutput`` and
``ModelRunnerOutput``): the engine core's ``schedule`` says which tokens of which requests run,
``execute_model`` runs them and samples, ``update_from_output`` applies the samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdcluster.engine.protocol import TokenLogprob

if TYPE_CHECKING:
    from pdcluster.engine.core.kv_connector import KVConnectorMetadata
    from pdcluster.engine.core.request import Request


@dataclass
class SchedulerOutput:
    """One step's plan. Every scheduled request computes ``num_new_tokens`` tokens from its
    ``num_computed_tokens`` on: 1 for a decode row (its last output token), a chunk for a
    prompt (or a recompute); ``max_num_batched_tokens`` bounds their sum.

    decoding: the decode rows, oldest first; chunks: (request, num_new_tokens) of the prompt
    chunks, after the rows in the batch; kv_connector_metadata: what the connector's worker
    side needs of the step (its chunks).
    """

    decoding: list[Request]
    chunks: list[tuple[Request, int]]
    kv_connector_metadata: KVConnectorMetadata

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """num_new_tokens per request id."""
        return {**{r.request_id: 1 for r in self.decoding},
                **{r.request_id: n for r, n in self.chunks}}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return len(self.decoding) + sum(n for _, n in self.chunks)

    @property
    def requests(self) -> list[Request]:
        return self.decoding + [r for r, _ in self.chunks]


@dataclass
class ModelRunnerOutput:
    """What a step's forward produced: for each request that samples this step (every decode
    row, then each prompt its last chunk completed, in batch order) the token drawn and its
    logprob entry (None unless the request asks for logprobs)."""

    sampled: list[tuple[Request, int, TokenLogprob | None]] = field(default_factory=list)
