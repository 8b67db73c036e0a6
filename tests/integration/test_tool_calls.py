"""Tool calls through the real openai client: `required` and named tool choices give calls
whose arguments validate against the tool's schema, streamed (name first, then argument
fragments) and whole; `auto` with each --tool-call-parser reads calls out of model outputs
crafted by a regex (two parallel calls, malformed JSON that comes back as content); histories
with calls and tool results are served; bad tool requests are 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from pdcluster.deploy.serve import gateway_app
from tests.background_server import BackgroundServer

pytestmark = pytest.mark.slow

MODEL = "stories260K"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Now.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(api_base) -> OpenAI:
    return OpenAI(base_url=api_base, api_key="unused", max_retries=0)


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> tuple[list[dict], str | None]:
    """Calls folded from a stream's tool-call deltas, checking each begins with id and name."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:
                assert d.id and d.function.name  # name first
                calls[d.index] = {"id": d.id, "name": d.function.name,
                                  "arguments": d.function.arguments or ""}
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_gives_valid_calls_whole_and_streamed(client, seed):
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)
    calls, finish = streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_parallel_required_calls_each_validate(client):
    """This model never closes the array on its own: it runs to max_tokens, and every call
    but the one it cut short validates."""
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
              temperature=1.0, seed=5, max_tokens=150)
    choice = client.chat.completions.create(**kw).choices[0]
    calls = choice.message.tool_calls
    assert choice.finish_reason == "length" and len(calls) >= 3
    check_calls(calls[:-1])
    streamed, _ = streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert [(c["name"], c["arguments"]) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in calls]


def test_a_named_tool_choice_calls_that_function(client):
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=3,
              max_tokens=60, tool_choice={"type": "function", "function": {"name": "get_time"}})
    out = client.chat.completions.create(**kw)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and out.choices[0].finish_reason == "stop"
    check_calls([call])
    calls, _ = streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [("get_time", call.function.arguments)]


HERMES_TWO = (r'Checking\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
              r'"unit": "celsius"\}\}</tool_call><tool_call>\{"name": "get_time", "arguments": '
              r'\{"zone": "UTC"\}\}</tool_call>')
HERMES_BROKEN = r'<tool_call>\{"name": get_weather</tool_call>'
LLAMA_TWO = (r'\{"name": "get_weather", "parameters": \{"city": "Rome", "unit": "celsius"\}\}; '
             r'\{"name": "get_time", "parameters": \{"zone": "CET"\}\}')
LLAMA_BROKEN = r'\{"name": "get_time", "parameters": \{"zone"'


@pytest.fixture(scope="module")
def parser_clients(cluster):
    """A gateway per --tool-call-parser, with --enable-auto-tool-choice, over the session
    cluster."""
    servers = {}
    try:
        for parser in ("hermes", "llama3_json"):
            config = cluster.config.model_copy(update={"tool_call_parser": parser,
                                                       "enable_auto_tool_choice": True})
            servers[parser] = BackgroundServer(gateway_app(config, cluster)).__enter__()
        yield {p: OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
               for p, s in servers.items()}
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)


@pytest.mark.parametrize("parser, regex, content, names", [
    ("hermes", HERMES_TWO, "Checking.", ["get_weather", "get_time"]),
    ("hermes", HERMES_BROKEN, '<tool_call>{"name": get_weather</tool_call>', []),
    ("llama3_json", LLAMA_TWO, None, ["get_weather", "get_time"]),
    ("llama3_json", LLAMA_BROKEN, '{"name": "get_time", "parameters": {"zone"', []),
])
def test_auto_tool_choice_reads_crafted_outputs(parser_clients, parser, regex, content, names):
    client = parser_clients[parser]
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300, temperature=1.0,
              seed=1, extra_body={"structured_outputs": {"regex": regex}})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.message.content == content
    assert [c.function.name for c in choice.message.tool_calls or ()] == names
    if names:
        check_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls"
    calls, finish = streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert [c["name"] for c in calls] == names
    assert [c["arguments"] for c in calls] == \
        [c.function.arguments for c in choice.message.tool_calls or ()]


def test_a_history_with_calls_and_tool_results_is_served(client, api_base):
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=4)
    assert out.choices[0].message.tool_calls is None
    rendered = httpx.post(f"{api_base.removesuffix('/v1')}/tokenize", json={
        "messages": history}).json()
    bare = httpx.post(f"{api_base.removesuffix('/v1')}/tokenize", json={
        "messages": MESSAGES}).json()
    assert rendered["count"] > bare["count"] + 10  # the call and its result are in the prompt


@pytest.mark.parametrize("fields, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice",
     "missing"),
    ({"tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({}, "tools", "--tool-call-parser"),  # auto is the default with tools
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}],
      "tool_choice": "none"}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}], "tool_choice": "required"}, "tools[0].function.parameters",
     "objectx"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "already constrains"),
])
def test_bad_tool_requests_are_400s(api_base, fields, param, words):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, **fields}
    response = httpx.post(f"{api_base}/chat/completions", timeout=30,
                          json={k: v for k, v in body.items() if v is not None})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
