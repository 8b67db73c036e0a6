"""/v1/responses as a translation (router.responses): the chat request it becomes (input
items merged into assistant turns by vLLM's rule, vllm/entrypoints/openai/responses/utils.py;
tool_choice, text.format, the fields it accepts without serving), and the events a chat
stream becomes; tests/integration/test_responses_api.py runs it through the openai client."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from pdcluster.router.api_common import APIError
from pdcluster.router.responses import ResponsesRequest, ResponseView, chat_request

CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
        "id": "fc_1", "status": "completed"}


def messages(**fields) -> list[dict]:
    chat = chat_request(ResponsesRequest.model_validate({"model": "m", **fields}))
    return [m.model_dump(exclude_none=True, exclude_defaults=True) for m in chat.messages]


def test_an_earlier_turns_items_make_one_assistant_message():
    """Our own output order (reasoning, message, calls), as a client sends it back."""
    turn = [{"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Think."}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Sure.", "annotations": []}]},
            CALL, {**CALL, "call_id": "c2"}]
    got = messages(instructions="Be kind.", input=[
        {"role": "user", "content": "Hi"}, *turn,
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Sum."}]},
        {"role": "assistant", "content": "Done."}])
    calls = [{"id": c, "function": {"name": "f", "arguments": "{}"}} for c in ("c1", "c2")]
    assert got == [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sure."}],
         "reasoning": "Think.", "tool_calls": calls},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
        {"role": "tool", "content": "2", "tool_call_id": "c2"},
        {"role": "assistant", "content": "Done.", "reasoning": "Sum."}]


def test_a_second_message_or_reasoning_opens_a_new_assistant_message():
    got = messages(input=[{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "A"},
                          {"role": "assistant", "content": "B"}])
    assert [m.get("content") for m in got] == ["Hi", "A", "B"]


def test_tool_choice_and_text_format():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"},
            "defer_loading": False}
    chat = chat_request(ResponsesRequest(model="m", input="Hi", tool_choice="auto"))
    assert chat.tool_choice is None and chat.tools is None  # OpenAI's default, no tools
    chat = chat_request(ResponsesRequest.model_validate(
        {"model": "m", "input": "Hi", "tools": [tool],
         "tool_choice": {"type": "function", "name": "f"}}))
    assert chat.tool_choice.function.name == "f" and chat.tools[0].function.name == "f"
    chat = chat_request(ResponsesRequest.model_validate({
        "model": "m", "input": "Hi", "max_output_tokens": 7, "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_schema", "name": "x",
                            "schema": {"type": "object"}}}}))
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert (chat.max_completion_tokens, chat.reasoning_effort) == (7, "low")
    with pytest.raises(APIError, match="needs a name"):
        chat_request(ResponsesRequest.model_validate(
            {"model": "m", "input": "Hi", "text": {"format": {"type": "json_schema"}}}))


def test_neutral_values_of_fields_it_does_not_serve_are_accepted():
    ResponsesRequest.model_validate({
        "model": "m", "input": "Hi", "top_logprobs": 0, "store": True, "include": [],
        "stream_options": {"include_obfuscation": False}, "prompt_cache_retention": "24h",
        "background": False, "truncation": "auto", "max_tool_calls": None})
    for field, value in (("top_logprobs", 3), ("background", True), ("max_tool_calls", 2)):
        with pytest.raises(ValidationError, match=field):
            ResponsesRequest.model_validate({"model": "m", "input": "Hi", field: value})


def events_of(frames: list[dict], **fields) -> list[dict]:
    """The Responses events of a chat completion stream of `frames` (parsed back)."""

    async def chat_sse():
        for frame in frames:
            yield f"data: {json.dumps(frame)}\n\n"
        yield "data: [DONE]\n\n"

    async def collect() -> list[str]:
        view = ResponseView(ResponsesRequest(model="m", input="Hi", stream=True, **fields), 0)
        return [e async for e in view.events(chat_sse())]

    out = []
    for event in asyncio.run(collect()):
        kind, data = event.strip().split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {out[-1]['type']}"
    return out


def delta(**d) -> dict:
    return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}


def test_interleaved_deltas_become_items_in_order():
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
             "completion_tokens_details": {"reasoning_tokens": 1}}
    events = events_of([
        delta(role="assistant"), delta(reasoning="Hm"), delta(content="A"), delta(content="B"),
        delta(tool_calls=[{"index": 0, "id": "c1", "type": "function",
                           "function": {"name": "f", "arguments": ""}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": "{}"}},
                          {"index": 1, "id": "c2", "type": "function",
                           "function": {"name": "g", "arguments": "[1]"}}]),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": usage}])
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call",
                                                    "function_call"]
    assert final["output"][1]["content"][0]["text"] == "AB"
    assert [(i["call_id"], i["arguments"]) for i in final["output"][2:]] == [("c1", "{}"),
                                                                             ("c2", "[1]")]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 1}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_stream_that_fails_leaves_its_open_item_incomplete():
    events = events_of([delta(content="Hal"), {"error": {"message": "worker died"}}])
    assert [e["type"] for e in events[-3:]] == ["response.content_part.done",
                                                "response.output_item.done", "response.failed"]
    assert events[-2]["item"]["status"] == "incomplete"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "worker died"
