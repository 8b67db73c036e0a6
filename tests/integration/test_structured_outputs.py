"""Structured outputs through the real openai client: seeded chat completions at temperature 1
under a JSON schema, a regex and a choice all parse and validate (jsonschema, re); bad specs are
400s with OpenAI's error body; a grammar that cannot end within max_tokens ends with "length".

The session cluster disaggregates every request (--pd-decider always): the prefill samples
token 0 under the grammar and the decode resumes the matcher from it. The decode-local path is
run by tests/integration/test_pd_decider.py with the same checks, migration by the chaos suite.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI

pytestmark = pytest.mark.slow

MODEL = "stories260K"
NUM_REQUESTS = 50
#: nested object, enum, array with maxItems, required fields, additionalProperties false
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "object",
                "properties": {"kind": {"enum": ["cat", "dog", "bird"]},
                               "toys": {"type": "array", "maxItems": 3,
                                        "items": {"type": "string", "maxLength": 10}}},
                "required": ["kind", "toys"], "additionalProperties": False},
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
REGEX = r"(Tom|Lily|Sam) (has|had) [1-9][0-9]? (cats|dogs)\."
CHOICES = ["happy", "sad", "angry", "sleepy"]
PROMPT = [{"role": "user", "content": "Tell me about a child and a pet."}]


async def chat_contents(api_base: str, num: int, **fields) -> list[tuple[str, str]]:
    """(content, finish_reason) of `num` chat completions seeded 0..num-1 at temperature 1,
    run concurrently; `fields` go in the body (extra_body for vLLM's)."""
    client = AsyncOpenAI(base_url=api_base, api_key="unused", max_retries=0, timeout=120)
    openai_fields = {k: fields.pop(k) for k in ("response_format",) if k in fields}

    async def one(seed: int) -> tuple[str, str]:
        out = await client.chat.completions.create(
            model=MODEL, messages=PROMPT, temperature=1.0, seed=seed, max_tokens=200,
            extra_body=fields, **openai_fields)
        return out.choices[0].message.content, out.choices[0].finish_reason

    try:
        return await asyncio.gather(*(one(seed) for seed in range(num)))
    finally:
        await client.close()


def check_json_schema(outputs: list[tuple[str, str]]) -> None:
    for content, finish in outputs:
        assert finish == "stop", (content, finish)
        jsonschema.validate(json.loads(content), SCHEMA)


def check_regex(outputs: list[tuple[str, str]]) -> None:
    for content, finish in outputs:
        assert finish == "stop" and re.fullmatch(REGEX, content), (content, finish)


def check_choice(outputs: list[tuple[str, str]]) -> None:
    assert {content for content, _ in outputs} <= set(CHOICES)
    assert all(finish == "stop" for _, finish in outputs)


def run_all_kinds(api_base: str) -> None:
    """NUM_REQUESTS completions under each of the JSON schema, the regex and the choice."""
    json_schema = {"type": "json_schema",
                   "json_schema": {"name": "child", "schema": SCHEMA, "strict": True}}
    check_json_schema(asyncio.run(chat_contents(api_base, NUM_REQUESTS,
                                                response_format=json_schema)))
    check_regex(asyncio.run(chat_contents(api_base, NUM_REQUESTS,
                                          structured_outputs={"regex": REGEX})))
    check_choice(asyncio.run(chat_contents(api_base, NUM_REQUESTS,
                                           structured_outputs={"choice": CHOICES})))


def test_json_schema_regex_and_choice_outputs_all_validate(api_base):
    run_all_kinds(api_base)


def test_json_object_grammar_and_structural_tag(api_base):
    outputs = asyncio.run(chat_contents(api_base, 8, response_format={"type": "json_object"}))
    # any object: this model's strings run past max_tokens, so each output is an object's
    # start, and any finished one parses
    assert all(c.startswith('{"') for c, _ in outputs), outputs
    assert all(isinstance(json.loads(c), dict) for c, finish in outputs if finish == "stop")
    grammar = 'root ::= "The " animal " is " color "."\nanimal ::= "cat" | "dog"\n' \
              'color ::= "red" | "blue"'
    for content, _ in asyncio.run(chat_contents(api_base, 4,
                                                structured_outputs={"grammar": grammar})):
        assert re.fullmatch(r"The (cat|dog) is (red|blue)\.", content), content
    tag = {"type": "structural_tag", "triggers": ["<pet>"],
           "structures": [{"begin": "<pet>", "end": "</pet>",
                           "schema": {"enum": ["cat", "dog"]}}]}
    for content, _ in asyncio.run(chat_contents(api_base, 4,
                                                structured_outputs={"structural_tag": tag})):
        for segment in re.findall(r"<pet>(.*?)</pet>", content, re.S):
            assert json.loads(segment) in ("cat", "dog"), content


def test_completions_take_structured_outputs_too(api_base):
    out = httpx.post(f"{api_base}/completions", timeout=60, json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 50, "seed": 3,
        "structured_outputs": {"regex": REGEX}}).json()
    assert re.fullmatch(REGEX, out["choices"][0]["text"]), out


def test_a_grammar_that_cannot_end_within_max_tokens_finishes_with_length(api_base):
    [(content, finish)] = asyncio.run(chat_contents(
        api_base, 1, max_tokens=3, structured_outputs={"json": SCHEMA}))
    assert finish == "length" and content.startswith("{")


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs",
     "undefined_rule"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format", "one"),
])
def test_bad_specs_are_400s_that_name_the_problem(api_base, fields, param, words):
    response = httpx.post(f"{api_base}/chat/completions", timeout=30, json={
        "model": MODEL, "messages": PROMPT, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error
