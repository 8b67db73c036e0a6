"""OpenAI API request bodies (pydantic), per the OpenAI API reference for /v1/completions and
/v1/chat/completions, with vLLM's extensions (`top_k`, `min_p`, `min_tokens`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `return_token_ids`) and `cache_salt`.

Unknown fields are rejected (400): a typo'd sampling field silently ignored would change
results without telling the user.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.protocol import MAX_LOGPROBS, SamplingParams

MAX_N = 16
MAX_STOP_STRINGS = 16
#: Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`, vllm/sampling_params.py):
#: logits divided by 1e-170 overflow to inf and the distribution to NaN.
SAMPLING_EPS = 1e-5
MIN_REPETITION_PENALTY = 0.01


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share. Infinity and NaN (which Python's JSON parser accepts) are
    refused in every float field."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM accepts any value > 0; past 100x either way a seen token is already certain or
    # impossible, and 5e-324 overflowed the penalized logits to inf (found by the fuzz test)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY,
                                      le=1 / MIN_REPETITION_PENALTY)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    return_token_ids: bool = False

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed: int | None) -> SamplingParams:
        """Raises ValueError for combinations pydantic's per-field checks cannot see."""
        temperature = 0.0 if self.temperature < SAMPLING_EPS else self.temperature
        # a top_p this small keeps only the most likely token either way; smaller ones
        # underflow to 0 in float32 and drop every token (found by the fuzz test)
        top_p = max(self.top_p, SAMPLING_EPS)
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=self.top_k, min_p=self.min_p, seed=seed,
            stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    """Body of POST /v1/completions. `prompt`: a string, a list of strings, a token-id list,
    or a list of token-id lists; each prompt gets `n` choices (index = prompt × n + i)."""

    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """Body of POST /v1/chat/completions. max_completion_tokens wins over the deprecated
    max_tokens; with neither, the rest of the context is the limit (vLLM's behaviour)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
