"""POST /v1/responses through the real openai client (`client.responses.create`, whose types
parse every object and event): the same reply as the chat completion of the same
conversation, whole or as the event sequence; function calls (a named tool choice) and their
outputs in the next input; JSON under text.format; reasoning items with --reasoning-parser;
what it cannot serve is a 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI


pytestmark = pytest.mark.slow

MODEL = "stories260K"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}


@pytest.fixture(scope="module")
def client(api_base) -> OpenAI:
    return OpenAI(base_url=api_base, api_key="unused", max_retries=0)


def chat_text(client: OpenAI, messages: list[dict], **fields) -> tuple[str, str, int]:
    """The greedy chat reply's text, finish reason and completion tokens."""
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           **fields)
    return (reply.choices[0].message.content, reply.choices[0].finish_reason,
            reply.usage.completion_tokens)


def test_a_response_is_the_chat_reply_of_its_conversation(client):
    messages = [{"role": "system", "content": "Be kind."},
                {"role": "user", "content": "Tell me a story."}]
    want, finish, tokens = chat_text(client, messages, max_tokens=12)
    response = client.responses.create(model=MODEL, instructions="Be kind.",
                                       input="Tell me a story.", max_output_tokens=12,
                                       temperature=0)
    assert response.output_text == want and response.object == "response"
    assert [item.type for item in response.output] == ["message"]
    assert response.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output[-1].status == "incomplete"
    assert response.usage.output_tokens == tokens and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + tokens


def test_streamed_events_spell_the_same_reply(client):
    whole = client.responses.create(model=MODEL, input="Once upon a time", temperature=0,
                                    max_output_tokens=10)
    events = list(client.responses.create(model=MODEL, input="Once upon a time",
                                          temperature=0, max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", events[-1].type]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_named_tool_choice_calls_and_its_output_goes_back(client):
    response = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    streamed = list(client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[TOOL], stream=True,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40))
    added = next(e for e in streamed if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    assert done.arguments == "".join(e.delta for e in streamed
                                     if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    # the call and its output as the next turn's input (as the Agents SDK sends them)
    history = ["What is the weather in Paris?", calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny."}]
    follow = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=8, tools=[TOOL],
        tool_choice="none", input=[{"role": "user", "content": history[0]}, *history[1:]])
    want, _, _ = chat_text(client, [
        {"role": "user", "content": history[0]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": calls[0].call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny."}],
        max_tokens=8, tools=[{"type": "function", "function": {
            "name": "get_weather", "parameters": WEATHER}}], tool_choice="none")
    assert follow.output_text == want


def test_text_format_json_schema_constrains_the_output(client):
    response = client.responses.create(
        model=MODEL, input="Name a city.", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "city", "schema": WEATHER}})
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "input_image", "image_url": "data:,"}]}, "input.0"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"reasoning": {"effort": "low"}, "input": [{"type": "reasoning", "summary": [],
                                                "encrypted_content": "x"}]}, "encrypted"),
    ({"frobnicate": 1}, "frobnicate")])
def test_what_it_cannot_serve_is_a_400(client, fields, param):
    with pytest.raises(BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", extra_body=fields)
    assert param in json.dumps(info.value.body), info.value.body


def test_reasoning_is_an_item_of_its_own(reasoning_api_base):
    """The bundled model never ends its thinking: with a reasoning parser every token is
    reasoning (tests/integration/test_reasoning_parser.py), here a reasoning item."""
    client = OpenAI(base_url=reasoning_api_base, api_key="unused", max_retries=0)
    response = client.responses.create(model=MODEL, input="Tell me a story.", temperature=0,
                                       max_output_tokens=8)
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].content[0].text
    usage = response.usage
    assert usage.output_tokens_details.reasoning_tokens == usage.output_tokens > 0
    events = httpx.post(f"{reasoning_api_base}/responses", timeout=60, json={
        "model": MODEL, "input": "Tell me a story.", "temperature": 0,
        "max_output_tokens": 8, "stream": True}).text
    deltas = [json.loads(line[6:]) for line in events.splitlines()
              if line.startswith("data: ")]
    text = "".join(d["delta"] for d in deltas if d["type"] == "response.reasoning_text.delta")
    assert text == response.output[0].content[0].text
