"""Messages between the gateway, the prefill worker and the decode worker.

These travel over Ray's control plane (trusted cluster). They carry handles and deltas — token
ids, block keys, a KV store address — never KV tensors (STYLE.md item 12). KV bytes go over the
KV store's gRPC data plane.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it before softmax.
    seed: the random stream for output token t is derived from (seed, t) only, so a request's
        text does not depend on batch composition (DESIGN.md "Sampling"). None draws a seed at
        admission, so the request is still reproducible internally.
    max_tokens: number of tokens to generate (>= 1), counting the first (prefill) token.
    stop_token_ids: ids that end the request in addition to the model's EOS ids.
    ignore_eos: keep generating past EOS until max_tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


class FinishReason(str, enum.Enum):
    """OpenAI's finish_reason values."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class PrefillRequest:
    """What the gateway sends a prefill worker.

    prompt_token_ids: the tokenized prompt (BOS included when the tokenizer adds one).
    cache_salt: optional per-tenant salt mixed into block keys (STYLE.md trap 7).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str | None = None


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker returns: the first token and where the prompt's KV now lives.

    block_keys: chained sha256 keys of the prompt's full blocks, published on the KV store at
        kv_address.
    tail_handle: handle of the partial tail block on that store (None when the prompt length is a
        multiple of the block size); never keyed or indexed.
    num_tail_tokens: tokens in the tail block.
    first_token: token sampled from the last prompt position (output token 0).
    prefill_worker_id / prefill_pid: which actor and process computed it (for tests and tracing).
    """

    request_id: str
    first_token: int
    kv_address: str
    block_keys: tuple[bytes, ...]
    tail_handle: str | None
    num_tail_tokens: int
    num_computed_tokens: int
    prefill_worker_id: str
    prefill_pid: int


@dataclass(frozen=True)
class DecodeRequest:
    """What the gateway sends a decode worker after prefill."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    prefill: PrefillResult


@dataclass(frozen=True)
class TokenDelta:
    """One streamed item from a decode worker: the new tokens since the last item.

    finish_reason is set on the last item; num_forward_tokens counts the tokens this decode
    worker ran through the model for the request (the prompt is never recomputed, so it is
    generated − 1 on a normal finish); error carries a message when finish_reason is ERROR.
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    num_forward_tokens: int = 0
    decode_worker_id: str = ""
    decode_pid: int = 0
    error: str | None = None
    extra: dict = field(default_factory=dict)
