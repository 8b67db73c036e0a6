"""POST /tokenize and /detokenize, with vLLM's request and response shapes
(vllm/entrypoints/openai/protocol.py: TokenizeCompletionRequest, TokenizeChatRequest,
DetokenizeRequest): a prompt or chat messages in (rendered as /v1/chat/completions renders
them, with the same template options and tools); `tokens`, `count` and `max_model_len` out.
Routers that score prefixes (llm-d's precise prefix scorer) call these."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdcluster.engine.tokenizer import TokenizerError
from pdcluster.router.api_common import APIError, ServingContext
from pdcluster.router.chat import render_messages
from pdcluster.router.chat_template import ChatTemplate
from pdcluster.router.schemas import ChatMessage, ChatTemplateFields


class TokenizeRequest(ChatTemplateFields):
    """`prompt` (vLLM's completion form, special tokens added by default) or `messages` (its
    chat form: rendered by the chat template, which places the special tokens)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def tokenize(body: TokenizeRequest, ctx: ServingContext, template: ChatTemplate) -> dict:
    """Raises APIError(404) for another model's name, (400) for text that cannot be
    tokenized or messages the chat template refuses."""
    if body.model is not None:
        ctx.check_model(body.model)
    if body.messages is not None:
        text = render_messages(template, body.messages, body)
        ids = ctx.encode(text, "messages", add_special_tokens=bool(body.add_special_tokens))
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = ctx.encode(body.prompt, "prompt", add_special_tokens=special)
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
            "token_strs": ctx.tokenizer.pieces(ids) if body.return_token_strs else None}


def detokenize(body: DetokenizeRequest, ctx: ServingContext) -> dict:
    """Raises APIError(400) for an id outside the vocabulary."""
    if body.model is not None:
        ctx.check_model(body.model)
    try:
        ctx.tokenizer.pieces(body.tokens)
    except TokenizerError as exc:
        raise APIError(400, str(exc), "tokens") from exc
    return {"prompt": ctx.tokenizer.decode(body.tokens)}
