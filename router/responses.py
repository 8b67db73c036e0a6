"""POST /v1/responses (OpenAI's Responses API, which the OpenAI Agents SDK and Codex call),
served as a translation of chat completions: the input items become chat messages, the chat
reply's reasoning, text and tool calls become output items, and a streamed reply's chunks become
the Responses event sequence (`response.created` ... `response.completed`).

Stateless, as vLLM is without its response store: nothing is stored, `store` is accepted and
ignored, and `previous_response_id` is refused (a client sends the whole conversation in
`input`, as Codex does). Function tools only. The items a client sends back from an earlier
response rebuild its assistant turn as vLLM does (vllm/entrypoints/openai/responses/utils.py):
a reasoning item, the message and the function calls after it make one assistant message,
with its `reasoning` for templates that render it. Input is never truncated: `truncation:
"auto"` is accepted, and an input over the context is a 400 either way.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      field_validator, model_validator)

from pdcluster.router.api_common import APIError, ServingContext, validation_error
from pdcluster.router.chat import create_chat_completion
from pdcluster.router.chat_template import ChatTemplate
from pdcluster.router.schemas import ChatCompletionRequest
from pdcluster.router.unsupported_fields import (RESPONSES_FIELDS, RESPONSES_TOOL_FIELDS,
                                                 drop_neutral)


class ContentPart(BaseModel):
    """A text part of an input message (`input_text`, or an earlier reply's `output_text`)."""

    model_config = ConfigDict(extra="ignore")  # output_text's annotations and logprobs
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # an earlier reply's id and status
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: None = None  # this server encrypts nothing

    def text(self) -> str:
        """Its reasoning text; the summary's when it has no content (vLLM's rule)."""
        if self.content:
            return self.content[0].text
        return self.summary[0].text if self.summary else ""


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")
    return kind if kind in _ITEM_TYPES else None


InputItem = Annotated[Annotated[MessageItem, Tag("message")]
                      | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")],
                      Discriminator(_item_type, custom_error_type="unsupported_feature",
                                    custom_error_message="input items other than "
                                    + ", ".join(_ITEM_TYPES) + " are not supported")]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return drop_neutral(data, RESPONSES_TOOL_FIELDS, "tools: ")


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON under a schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries: ignored
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """Body of POST /v1/responses (OpenAI's fields this server serves; module docstring)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    previous_response_id: None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return drop_neutral(data, RESPONSES_FIELDS, "")

    @field_validator("previous_response_id", mode="before")
    @classmethod
    def _stateless(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("this server stores no responses: send the whole conversation in "
                             "`input` instead of previous_response_id")
        return value


async def create_response(body: ResponsesRequest, ctx: ServingContext,
                          template: ChatTemplate):
    """The Responses API reply (a `response` object, or its event stream) of `body`.
    Raises APIError as chat completions do, and 400 for input no chat request can hold."""
    chat = chat_request(body)
    reply = await create_chat_completion(chat, ctx, template)
    view = ResponseView(body, int(time.time()))
    if not body.stream:
        return JSONResponse(view.whole(json.loads(reply.body)))
    return StreamingResponse(view.events(reply.body_iterator), media_type="text/event-stream")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that `body` asks for. Raises APIError(400) when that is
    not a valid chat request (say, a tool name chat's rules refuse)."""
    fields: dict[str, Any] = {"model": body.model, "messages": _messages(body),
                              "stream": body.stream}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    optional = {
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls,
        "user": body.user,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                exclude_none=True)}
                  for t in body.tools] or None,
        "tool_choice": _tool_choice(body),
        "response_format": _response_format(body.text),
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc


def _tool_choice(body: ResponsesRequest) -> str | dict | None:
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    # OpenAI's default is "auto" with or without tools; chat's "auto" needs some
    return choice if body.tools or choice not in ("auto", "none") else None


def _response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None:
        raise APIError(400, "text.format of type json_schema needs a name", "text")
    schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description,
              "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items()
                                                   if v is not None}}


def _text(content: str | list[ContentPart]) -> str | list[dict]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


def _messages(body: ResponsesRequest) -> list[dict]:
    """`instructions` as a system message, then the input items as chat messages. An
    assistant turn's items merge as vLLM merges them: its reasoning, message and function
    calls fill one assistant message until a part it already has comes again; a call's
    output is a tool message."""
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) \
        else body.input

    def assistant(part: str) -> dict:
        """The assistant message to fill `part` of: the last one while it lacks that part."""
        if not (messages and messages[-1]["role"] == "assistant"
                and messages[-1].get(part) is None):
            messages.append({"role": "assistant", "content": None})
        return messages[-1]

    for item in items:
        if isinstance(item, MessageItem) and item.role == "assistant":
            assistant("content")["content"] = _text(item.content)
        elif isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, ReasoningItem):
            assistant("reasoning")["reasoning"] = item.text()
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            message = messages[-1] if messages and messages[-1]["role"] == "assistant" \
                else assistant("tool_calls")
            message.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) \
                else "\n".join(part.text for part in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    if not messages:
        raise APIError(400, "input holds no message", "input")
    return messages


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseView:
    """One request's reply in the Responses API's shapes."""

    def __init__(self, body: ResponsesRequest, created_at: int) -> None:
        self.body = body
        self.id = _new_id("resp")
        self.created_at = created_at

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: str | None = None, error: dict | None = None) -> dict:
        """The `response` object; usage: the chat usage it reports (None: not yet)."""
        body = self.body
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": body.model, "output": output,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools],
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionToolChoice)
            else choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text and body.text.format else {"type": "text"}},
            "reasoning": body.reasoning.model_dump(exclude_none=True) if body.reasoning
            else None,
            "metadata": body.metadata, "user": body.user, "store": False,
            "previous_response_id": None, "truncation": "disabled",
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "error": error, "usage": _usage(usage) if usage else None,
        }

    def whole(self, chat: dict) -> dict:
        """The response to an unstreamed chat completion `chat`."""
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning"):
            output.append(_reasoning_item(_new_id("rs"), message["reasoning"], "completed"))
        if message.get("content"):
            output.append(_message_item(_new_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or []:
            output.append(_call_item(_new_id("fc"), call["id"], call["function"]["name"],
                                     call["function"]["arguments"], "completed"))
        incomplete = "max_output_tokens" if choice["finish_reason"] == "length" else None
        if incomplete and output:  # the item the limit cut, as OpenAI marks it
            output[-1]["status"] = "incomplete"
        return self.response("incomplete" if incomplete else "completed", output,
                             chat["usage"], incomplete)

    async def events(self, chunks: AsyncGenerator[str, None]) -> AsyncIterator[str]:
        """The Responses event stream of a streamed chat completion's SSE `chunks`."""
        stream = _EventStream(self)
        yield stream.emit("response.created", response=self.response("in_progress", []))
        yield stream.emit("response.in_progress", response=self.response("in_progress", []))
        finish, usage, error = None, None, None
        try:
            async for frame in chunks:
                for line in frame.splitlines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        error = chunk["error"]
                        continue
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices", []):
                        for event in stream.feed(choice["delta"]):
                            yield event
                        finish = choice.get("finish_reason") or finish
        finally:
            await chunks.aclose()  # a client gone mid-stream: aborts the generation
        cut = error is not None or finish == "length"
        for event in stream.close_item("incomplete" if cut else "completed"):
            yield event
        if error is not None:
            yield stream.emit("response.failed", response=self.response(
                "failed", stream.output, usage,
                error={"code": "server_error", "message": error.get("message", "")}))
            return
        if finish == "length":
            yield stream.emit("response.incomplete", response=self.response(
                "incomplete", stream.output, usage, "max_output_tokens"))
            return
        yield stream.emit("response.completed",
                          response=self.response("completed", stream.output, usage))


class _EventStream:
    """Output items opened and closed as chat deltas arrive: one item per run of reasoning,
    of text, or per tool call, each with its added / delta / done events."""

    def __init__(self, view: ResponseView) -> None:
        self.view = view
        self.sequence = 0
        self.output: list[dict] = []  # closed items
        self.open: dict | None = None  # the item deltas go to
        self.text = ""

    def emit(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"

    def feed(self, delta: dict) -> list[str]:
        events: list[str] = []
        if delta.get("reasoning"):
            events += self._into("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._into("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):  # a new call: its id and name come first
                events += self.close_item()
                self.open = _call_item(_new_id("fc"), call["id"], function.get("name", ""), "",
                                       "in_progress")
                events.append(self._added())
            if function.get("arguments") and self.open is not None:
                self.text += function["arguments"]
                events.append(self.emit("response.function_call_arguments.delta",
                                        item_id=self.open["id"], output_index=self._index(),
                                        delta=function["arguments"]))
        return events

    def _into(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self.open is None or self.open["type"] != kind:
            events += self.close_item()
            self.open = (_reasoning_item(_new_id("rs"), "", "in_progress") if kind == "reasoning"
                         else _message_item(_new_id("msg"), "", "in_progress"))
            events.append(self._added())
            events.append(self.emit("response.content_part.added", item_id=self.open["id"],
                                    output_index=self._index(), content_index=0,
                                    part=_part(kind, "")))
        self.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.emit(name, item_id=self.open["id"], output_index=self._index(),
                                content_index=0, delta=text, **extra))
        return events

    def close_item(self, status: str = "completed") -> list[str]:
        """The done events of the open item, if any, which ends with `status` and joins the
        output."""
        item, text = self.open, self.text
        if item is None:
            return []
        self.open, self.text = None, ""
        index, events = len(self.output), []
        if item["type"] == "function_call":
            item = {**item, "arguments": text, "status": status}
            events.append(self.emit("response.function_call_arguments.done", item_id=item["id"],
                                    output_index=index, arguments=text))
        else:
            kind = item["type"]
            item = (_reasoning_item(item["id"], text, status) if kind == "reasoning"
                    else _message_item(item["id"], text, status))
            name, extra = (("response.reasoning_text.done", {}) if kind == "reasoning"
                           else ("response.output_text.done", {"logprobs": []}))
            events.append(self.emit(name, item_id=item["id"], output_index=index,
                                    content_index=0, text=text, **extra))
            events.append(self.emit("response.content_part.done", item_id=item["id"],
                                    output_index=index, content_index=0,
                                    part=_part(kind, text)))
        events.append(self.emit("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events

    def _added(self) -> str:
        return self.emit("response.output_item.added", output_index=self._index(),
                         item=self.open)

    def _index(self) -> int:
        return len(self.output)


def _part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [_part("reasoning", text)] if text else [], "status": status}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_part("message", text)] if text else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _usage(chat: dict) -> dict:
    """The Responses usage of a chat usage."""
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (chat.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat["total_tokens"]}
