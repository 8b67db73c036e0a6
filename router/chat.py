"""POST /v1/chat/completions (OpenAI chat completions), with tool calling
(router.tool_calls)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.engine.logs import bind_request_id
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.api_common import APIError, ServingContext, build_specs, respond
from pdcluster.router.chat_template import ChatTemplate, ChatTemplateError
from pdcluster.router.logprobs import chat_logprob_entry, vllm_prompt_logprobs
from pdcluster.router.reasoning import THINK_END, ReasoningStream
from pdcluster.router.schemas import (ChatCompletionRequest, ChatMessage, ChatTemplateFields,
                                      new_request_id)
from pdcluster.router.serving import ChoiceDelta
from pdcluster.router.tool_calls import (ToolChoiceError, ToolPlan, new_call_id, plan,
                                         template_tool_calls, template_tools, tool_specs)
from pdcluster.router.tool_parsers import CallArguments, CallStart, Content, Event, ToolCallStream


async def create_chat_completion(body: ChatCompletionRequest, ctx: ServingContext,
                                 template: ChatTemplate):
    request_id = new_request_id("chatcmpl")
    bind_request_id(request_id)
    ctx.check_model(body.model)
    ctx.check_num_sequences(1, body.n)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    try:
        tools = plan(body.tools, body.tool_choice, body.parallel_tool_calls, ctx.tool_calling)
    except ToolChoiceError as exc:
        raise APIError(400, str(exc), exc.param) from exc
    for param, spec in tool_specs(body.tools):
        ctx.check_grammar(spec, param)
    grammar = ctx.structured_output(body)
    if tools is not None and tools.grammar is not None:
        if grammar is not None:
            raise APIError(400, f"tool_choice {tools.mode} already constrains the output; "
                           "send it without response_format or structured_outputs",
                           "tool_choice")
        grammar = tools.grammar
    text = render_messages(template, body.messages, body)
    prompt = ctx.truncated(
        ctx.encode(text, "messages", add_special_tokens=body.add_special_tokens), body)
    requested = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = ctx.max_tokens_for(prompt, requested, param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # a grammar holds after the reasoning, as vLLM's structured outputs do
    thinks = ctx.reasoning is not None and ctx.reasoning.thinks(body.template_kwargs())
    reasoning_end = ctx.reasoning_markers[THINK_END] if thinks and grammar is not None else ()
    specs = build_specs(ctx, body, [prompt], [max_tokens], logprobs, grammar,
                        reasoning_end=reasoning_end)
    reasoning_tokens = None
    if ctx.reasoning is not None:
        counts = [ctx.reasoning.token_count(ctx.reasoning_markers, body.template_kwargs())
                  for _ in specs]

        def reasoning_tokens(delta: ChoiceDelta) -> int:
            counts[delta.index].feed(delta.token_ids)
            return sum(c.count for c in counts)
    # vLLM's reply role: the last message's own when no generation prompt opens a new one
    last = body.messages[-1]
    role = "assistant" if body.add_generation_prompt else last.role
    echo = last.text() if body.echo and last.role == role else ""
    states = [_ChoiceState(tools, ctx.reasoning.stream(body.template_kwargs())
                           if ctx.reasoning is not None else None, role, echo)
              for _ in specs]
    whole = None
    if body.prompt_logprobs is not None:  # vLLM's: beside the choices, not in them
        def whole(choices: list[ChoiceDelta]) -> dict:
            return {"prompt_logprobs": vllm_prompt_logprobs(choices[0].prompt_logprobs or [],
                                                            body.prompt_logprobs,
                                                            ctx.tokenizer)}
    return await respond(ctx, body, request_id, [prompt], specs, "chat.completion",
                         "chat.completion.chunk",
                         lambda delta: _choice(delta, body, ctx.tokenizer, states[delta.index]),
                         whole, reasoning_tokens=reasoning_tokens)


def render_messages(template: ChatTemplate, messages: list[ChatMessage],
                    options: ChatTemplateFields) -> str:
    """The prompt text of `messages` with the request's template options (chat completions
    and /tokenize alike). Raises APIError(400) when the template refuses them."""
    try:
        return template.render([template_message(m) for m in messages],
                               options.add_generation_prompt, template_tools(options.tools),
                               options.continue_final_message, options.documents,
                               options.template_kwargs())
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), "messages") from exc


def template_message(message: ChatMessage) -> dict:
    """A history message as a chat template reads it (transformers' and vLLM's shape)."""
    out: dict = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = template_tool_calls(message.tool_calls)
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.role == "assistant" and message.reasoning is not None:
        # vLLM's: under both names, for templates that re-render recent thinking (Qwen3's
        # after the last user turn, in a tool loop)
        out["reasoning"] = out["reasoning_content"] = message.reasoning
    return out


@dataclass
class _ChoiceState:
    """One choice across its stream chunks: whether its role went out, its reasoning (with
    --reasoning-parser) and its tool calls."""

    tools: ToolPlan | None
    reasoning: ReasoningStream | None = None
    role: str = "assistant"
    echo: str = ""  # what its content starts with (vLLM's chat echo)
    started: bool = False
    calls: ToolCallStream | None = None
    call_ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.tools is not None:
            self.calls = self.tools.stream()

    def read(self, text: str, final: bool) -> list[Event]:
        events = self.calls.feed(text)
        return events + self.calls.finish() if final else events

    def call_id(self, index: int) -> str:
        while len(self.call_ids) <= index:
            self.call_ids.append(new_call_id())
        return self.call_ids[index]


def _choice(delta: ChoiceDelta, body: ChatCompletionRequest, tokenizer: Tokenizer,
            state: _ChoiceState) -> dict:
    """A stream chunk's choice ("delta") or a whole one ("message"). The first of a choice
    carries the role: the first chunk of a streamed choice, and every whole one."""
    finish = delta.finish_reason
    text, reasoning = delta.text, ""
    if state.reasoning is not None:
        reasoning, text = state.reasoning.feed(text, finish is not None)
    message: dict = {"content": text}
    if state.calls is not None:
        events = state.read(text, finish is not None)
        content = "".join(e.text for e in events if isinstance(e, Content))
        calls = _stream_calls(events, state) if body.stream else _whole_calls(events, state)
        message = {"content": content or None}
        if calls:
            message["tool_calls"] = calls
        if finish == "stop" and state.calls.num_calls:
            finish = state.tools.finish_reason
    # vLLM's: a whole message always has `reasoning`, null where there is none; hidden
    # reasoning (include_reasoning false) shows in no token ids or logprobs either
    hidden = state.reasoning is not None and not body.include_reasoning
    if state.reasoning is not None:
        message["content"] = message["content"] or None
    if (reasoning and not hidden) or not body.stream:
        message["reasoning"] = None if hidden else reasoning or None
    if not state.started:
        state.started = True
        if state.echo:
            message["content"] = state.echo + (message["content"] or "")
        message = {"role": state.role, **message}
    choice = {"index": delta.index, "delta" if body.stream else "message": message,
              "logprobs": {"content": [chat_logprob_entry(e, tokenizer,
                                                          bool(body.return_tokens_as_token_ids))
                                       for e in delta.logprobs]}
              if body.logprobs and not hidden else None,
              "finish_reason": finish, "stop_reason": delta.stop_reason}
    if body.return_token_ids and not hidden:
        choice["token_ids"] = delta.token_ids
    return choice


def _stream_calls(events: list[Event], state: _ChoiceState) -> list[dict]:
    """OpenAI's streamed tool-call deltas: a call's id and name first, then its arguments
    in fragments."""
    out = []
    for e in events:
        if isinstance(e, CallStart):
            out.append({"index": e.index, "id": state.call_id(e.index), "type": "function",
                        "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, CallArguments):
            out.append({"index": e.index, "function": {"arguments": e.fragment}})
    return out


def _whole_calls(events: list[Event], state: _ChoiceState) -> list[dict]:
    calls: dict[int, dict] = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = {"id": state.call_id(e.index), "type": "function",
                              "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, CallArguments):
            calls[e.index]["function"]["arguments"] += e.fragment
    return [calls[i] for i in sorted(calls)]
