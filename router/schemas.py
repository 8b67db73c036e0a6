"""OpenAI API request bodies (pydantic), per the OpenAI API reference for /v1/completions and
/v1/chat/completions, with vLLM's extensions (`top_k`, `min_p`, `min_tokens`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `return_token_ids`, `add_special_tokens`,
`stream_options.continuous_usage_stats`, `allowed_token_ids`, `bad_words`,
`include_stop_str_in_output`, `skip_special_tokens`, `truncate_prompt_tokens`) and
`cache_salt`.

Unknown fields are rejected (400): a typo'd sampling field silently ignored would change
results without telling the user. Fields vLLM or OpenAI define that this server does not
implement are accepted with a value that asks for nothing and otherwise refused by name
(router/unsupported_fields.py).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from pdcluster.engine.protocol import MAX_LOGPROBS, SamplingParams, StructuredOutputSpec
from pdcluster.router.structured_outputs import ResponseFormat, StructuredOutputsParams, spec_of
from pdcluster.router.tool_calls import MessageToolCall, Tool, ToolChoice
from pdcluster.router.unsupported_fields import (CHAT_FIELDS, COMPLETION_FIELDS, MESSAGE_FIELDS,
                                                 TEXT_PART_TYPES, drop_neutral)

MAX_N = 16
#: vLLM's limits on a request's bad words (VLLM_MAX_NUM_BAD_WORDS, ..._TOTAL_TOKENS)
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOKENS = 1024
MAX_STOP_STRINGS = 16
#: Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`, vllm/sampling_params.py):
#: logits divided by 1e-170 overflow to inf and the distribution to NaN.
SAMPLING_EPS = 1e-5
MIN_REPETITION_PENALTY = 0.01


def _null_is(default: bool):
    return lambda value: default if value is None else value


#: vLLM's switches that this server accepted as null while it did not serve them: null still
#: means the default
OffByDefault = Annotated[bool, BeforeValidator(_null_is(False))]
OnByDefault = Annotated[bool, BeforeValidator(_null_is(True))]


class StreamOptions(BaseModel):
    """include_usage: a last chunk with the request's usage; continuous_usage_stats (vLLM):
    with include_usage, every chunk also carries the usage so far."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI's: token id (a JSON key) -> bias; vLLM clamps a bias to [-100, 100]
    logit_bias: dict[Annotated[int, Field(ge=0)], float] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]],
                                 Field(min_length=1)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1)]],
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    include_stop_str_in_output: OffByDefault = False
    skip_special_tokens: OnByDefault = True
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprob tokens as `token_id:N`
    # vLLM's: keep this many prompt tokens (-1: max_model_len), the last ones unless
    # truncation_side is "right"
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: lower is served earlier; other than 0 only with --scheduling-policy priority
    priority: int | None = Field(None, ge=-2**63, lt=2**63)

    def structured_output(self) -> StructuredOutputSpec | None:
        """The grammar the request asks for (router.structured_outputs); raises ValueError
        when it asks for more than one."""
        return spec_of(self.response_format, self.structured_outputs)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def prompt_logprobs_k(self) -> int | None:
        """How many top entries each prompt token's logprob carries (None: none computed)."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed: int | None,
                        structured_output: StructuredOutputSpec | None = None,
                        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
                        reasoning_end_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """bad_words_token_ids: `bad_words` tokenized (router.api_common);
        reasoning_end_token_ids: where a grammar starts (router.chat). Raises ValueError for
        combinations pydantic's per-field checks cannot see."""
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
            repetition_penalty=self.repetition_penalty, logprobs=logprobs,
            structured_output=structured_output, prompt_logprobs=self.prompt_logprobs_k(),
            logit_bias=tuple((t, min(100.0, max(-100.0, b)))
                             for t, b in (self.logit_bias or {}).items()),
            allowed_token_ids=(tuple(sorted(set(self.allowed_token_ids)))
                               if self.allowed_token_ids is not None else None),
            bad_words_token_ids=bad_words_token_ids,
            reasoning_end_token_ids=reasoning_end_token_ids if structured_output else (),
            priority=self.priority or 0)


_PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object",
               list: "array", type(None): "null"}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _check_prompt(value: Any) -> Any:
    """The `prompt` of a completion request, checked with messages that say what is wrong
    where (a plain union would report one failed alternative, e.g. "prompt.str: ...")."""

    def fail(message: str) -> PydanticCustomError:
        return PydanticCustomError("prompt_invalid", message)

    def token_ids(ids: list, where: str) -> None:
        if not ids:
            raise fail(f"{where} is an empty token list")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise fail(f"{where}[{i}] is {t!r}; token ids are integers >= 0")

    if isinstance(value, str):
        if not value:
            raise fail("prompt is empty")
        return value
    if not isinstance(value, list):
        raise fail(f"prompt must be {_PROMPT_FORMS} (got {_json_type(value)})")
    if not value:
        raise fail("prompt is an empty list")
    first = value[0]
    if isinstance(first, str):
        for i, p in enumerate(value):
            if not isinstance(p, str):
                raise fail(f"prompt[{i}] is {_json_type(p)}; a list of prompts holds "
                           "strings only")
            if not p:
                raise fail(f"prompt[{i}] is empty")
    elif isinstance(first, list):
        for i, p in enumerate(value):
            if not isinstance(p, list):
                raise fail(f"prompt[{i}] is {_json_type(p)}; a list of token-id lists "
                           "holds lists only")
            token_ids(p, f"prompt[{i}]")
    elif isinstance(first, int) and not isinstance(first, bool):
        token_ids(value, "prompt")
    else:
        raise fail(f"prompt[0] is {_json_type(first)}; prompt must be {_PROMPT_FORMS}")
    return value


Prompt = Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_check_prompt)]


class CompletionRequest(SamplingFields):
    """Body of POST /v1/completions. `prompt`: a string, a list of strings, a token-id list,
    or a list of token-id lists, none empty; each prompt gets `n` choices
    (index = prompt × n + i). `echo`: the choice's text (and logprobs) start with the prompt's;
    `max_tokens: 0` with echo or prompt_logprobs scores the prompt and generates nothing (what
    evaluation harnesses send for loglikelihoods)."""

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True
    echo: bool = False
    #: vLLM's (and OpenAI's legacy) best_of: this many candidates per prompt, the n with the
    #: highest cumulative logprob returned; not streamed
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _prompt_only(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise PydanticCustomError("max_tokens_zero", "max_tokens: 0 generates nothing; it "
                                      "needs echo or prompt_logprobs (to score the prompt)")
        if self.best_of is not None and self.best_of < self.n:
            raise PydanticCustomError("best_of", f"best_of ({self.best_of}) must be at least "
                                      f"n ({self.n})")
        if self.stream and self.candidates() > self.n:
            raise PydanticCustomError("best_of", "best_of > n cannot be streamed: the best "
                                      "are known only once all have finished")
        return self

    def candidates(self) -> int:
        """Sequences generated per prompt."""
        return self.best_of or self.n

    def prompt_logprobs_k(self) -> int | None:
        """echo with logprobs scores the prompt too, with as many top entries."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return drop_neutral(data, COMPLETION_FIELDS, "")

    def num_prompts(self) -> int:
        """How many prompts the request holds (before tokenizing)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return 1
        return len(self.prompt)


class TextPart(BaseModel):
    """A text content part. OpenAI's Responses-style `input_text` / `output_text` are text
    too; any other part type (image_url, input_audio, ...) is a modality this model lacks."""

    model_config = ConfigDict(extra="forbid")
    type: str
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("type"), str) and \
                data["type"] not in TEXT_PART_TYPES:
            raise PydanticCustomError(
                "unsupported_feature", "content parts of type `{field}` are not supported "
                "(this model takes text only)", {"field": data["type"]})
        return data


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning: str | None = None  # an assistant's thinking, for templates that render it

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return drop_neutral(data, MESSAGE_FIELDS, "messages: ")

    def text(self) -> str:
        """The content as text; text parts joined by newlines, as vLLM renders them
        (vllm/renderers/chat_utils.py)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatTemplateFields(BaseModel):
    """vLLM's chat-template options, which chat completions and /tokenize render alike
    (router.chat.render_messages)."""

    tools: list[Tool] | None = None
    add_generation_prompt: OnByDefault = True
    continue_final_message: OffByDefault = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables."""
        return dict(self.chat_template_kwargs or {})

    @field_validator("continue_final_message")
    @classmethod
    def _one_way_to_end(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise PydanticCustomError(
                "continue_final_message", "continue_final_message needs "
                "add_generation_prompt false: the model continues the last message")
        return value


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """Body of POST /v1/chat/completions. max_completion_tokens wins over the deprecated
    max_tokens; with neither, the rest of the context is the limit (vLLM's behaviour)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's default for chat: the template already places the special tokens
    add_special_tokens: bool = False
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: OnByDefault = True  # vLLM's: with --reasoning-parser, false drops it
    echo: OffByDefault = False  # vLLM's: the reply's content starts with a last assistant message
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort
        as vLLM passes it (with enable_thinking off at "none", unless the kwargs say)."""
        kwargs = super().template_kwargs()
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return drop_neutral(data, CHAT_FIELDS, "")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
