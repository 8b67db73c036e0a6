"""Bodies a vLLM client sends are served, or refused with a 400 that names the feature.

The known field set is vLLM's own (tests/router/vllm_request_fields.py, read from vLLM's
source). For every field a realistic value a vLLM client would send is posted: the answer is a
200, or a 400 whose code is `unsupported_feature` and whose message names the field — never
"Extra inputs are not permitted". True typos are still refused.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from tests.router.vllm_request_fields import (VLLM_CHAT_COMPLETION_FIELDS,
                                              VLLM_CHAT_MESSAGE_FIELDS, VLLM_COMPLETION_FIELDS,
                                              VLLM_CONTENT_PART_TYPES)

pytestmark = pytest.mark.slow

MODEL = "stories260K"
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}

#: A value a vLLM client might really send for each field (not its default).
PROBES = {
    "add_special_tokens": False, "allowed_token_ids": [1, 2, 3], "bad_words": ["dog"],
    "cache_salt": "tenant-a", "ec_transfer_params": {"x": 1}, "echo": True,
    "frequency_penalty": 0.5, "ignore_eos": True, "include_stop_str_in_output": True,
    "kv_transfer_params": {"do_remote_decode": True}, "length_penalty": 0.8,
    "logit_bias": {"5": -100}, "logprob_token_ids": [5, 6], "max_tokens": 2,
    "min_p": 0.05, "min_tokens": 1, "model": MODEL, "n": 2, "presence_penalty": 0.5,
    "priority": 1, "prompt_embeds": "AAAA", "prompt_logprobs": 1,
    "repetition_detection": {"max_pattern_size": 4}, "repetition_penalty": 1.1,
    "request_id": "client-req-1", "response_format": {"type": "json_object"},
    "return_mm_kwargs": True, "return_token_ids": True, "return_token_offsets": True,
    "return_tokens_as_token_ids": True, "routed_experts_prompt_start": 2, "seed": 7,
    "session_id": "conversation-9", "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "stop": ["\n\n"], "stop_token_ids": [2],
    "stream": True, "stream_interval": 4,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "structured_outputs": {"regex": "[a-z]+"}, "suffix": "The end.", "temperature": 0.7,
    "thinking_token_budget": 64, "top_k": 20, "top_p": 0.9, "truncate_prompt_tokens": 8,
    "truncation_side": "left", "use_beam_search": True, "user": "user-1",
    "vllm_xargs": {"k": 1}, "watermarking": True, "logprobs": 2,
    # chat only
    "add_generation_prompt": False, "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False}, "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}], "include_reasoning": False,
    "max_completion_tokens": 2, "media_io_kwargs": {"video": {"num_frames": 4}},
    "mm_processor_kwargs": {"num_crops": 4}, "parallel_tool_calls": False,
    "reasoning_effort": "low", "return_prompt_text": True,
    "tool_choice": "required", "top_logprobs": 2,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
}
CHAT_PROBES = {**PROBES, "logprobs": True}


@pytest.fixture(scope="module")
def http(api_base):
    with httpx.Client(base_url=api_base, timeout=60) as client:
        yield client


def check_served_or_named(response: httpx.Response, field: str) -> None:
    """Served, refused as a feature this server lacks, or refused for its value (a 400 whose
    param is the field: tools need --enable-auto-tool-choice, tool_choice needs tools)."""
    if response.status_code == 200:
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "Extra inputs" not in error["message"], (field, error)
    assert error["param"] == field or (
        error["code"] == "unsupported_feature" and f"`{field}`" in error["message"]), \
        (field, error)


def test_every_field_has_a_probe():
    assert (VLLM_COMPLETION_FIELDS | VLLM_CHAT_COMPLETION_FIELDS) - {"prompt", "messages"} \
        <= set(PROBES)


@pytest.mark.parametrize("field", sorted(VLLM_COMPLETION_FIELDS - {"prompt"}))
def test_completion_fields(http, field):
    body = {**COMPLETION, field: PROBES[field]}
    if field == "stream_options":
        body["stream"] = True
    check_served_or_named(http.post("/completions", json=body), field)


@pytest.mark.parametrize("field", sorted(VLLM_CHAT_COMPLETION_FIELDS - {"messages"}))
def test_chat_fields(http, field):
    body = {**CHAT, field: CHAT_PROBES[field]}
    if field == "stream_options":
        body["stream"] = True
    if field == "top_logprobs":
        body["logprobs"] = True
    check_served_or_named(http.post("/chat/completions", json=body), field)


MESSAGE_PROBES = {"audio": {"id": "a1"}, "function_call": {"name": "f", "arguments": "{}"},
                  "name": "alice", "reasoning": "I thought.", "reasoning_content": "Hmm.",
                  "refusal": "No.", "task": "x", "tool_call_id": "call_1",
                  "tool_calls": [{"id": "call_1", "type": "function",
                                  "function": {"name": "f", "arguments": "{}"}}],
                  "tools": [{"type": "function", "function": {"name": "f"}}]}


@pytest.mark.parametrize("field", sorted(VLLM_CHAT_MESSAGE_FIELDS - {"role", "content"}))
def test_message_fields(http, field):
    message = {"role": "assistant", "content": "Hello.", field: MESSAGE_PROBES[field]}
    body = {**CHAT, "messages": [{"role": "user", "content": "Hi"}, message,
                                 {"role": "user", "content": "Go on"}]}
    check_served_or_named(http.post("/chat/completions", json=body), field)


@pytest.mark.parametrize("part_type", sorted(VLLM_CONTENT_PART_TYPES))
def test_content_part_types(http, part_type):
    part = {"type": part_type, "text": "Hi"} if "text" in part_type else \
        {"type": part_type, part_type: {"url": "data:,"}}
    response = http.post("/chat/completions", json={**CHAT, "messages": [
        {"role": "user", "content": [part]}]})
    if response.status_code != 200:
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "unsupported_feature" and part_type in error["message"]


def test_neutral_values_of_unsupported_fields_are_served(http):
    body = {**CHAT, "tools": [], "tool_choice": "none", "echo": False, "priority": 0,
            "logit_bias": None, "use_beam_search": False, "skip_special_tokens": True,
            "response_format": {"type": "text"}, "parallel_tool_calls": True,
            "add_generation_prompt": True, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi"}],
                 "tool_calls": []}]}
    assert http.post("/chat/completions", json=body).status_code == 200
    # switches once only accepted at their defaults still take null for the default
    nulls = dict.fromkeys(["echo", "add_generation_prompt", "continue_final_message",
                           "include_reasoning", "skip_special_tokens",
                           "include_stop_str_in_output", "logit_bias", "allowed_token_ids",
                           "bad_words", "truncate_prompt_tokens", "reasoning_effort",
                           "chat_template_kwargs", "documents",
                           "return_tokens_as_token_ids"])
    response = http.post("/chat/completions", json={**CHAT, **nulls})
    assert response.status_code == 200, response.text


def test_typos_are_still_refused(http):
    response = http.post("/completions", json={**COMPLETION, "temprature": 0.5})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temprature"


def test_continuous_usage_stats_with_the_openai_client(api_base):
    client = OpenAI(base_url=api_base, api_key="unused")
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True,
                                       "continuous_usage_stats": True}})
    chunks = list(stream)
    prompt_tokens = chunks[-1].usage.prompt_tokens
    with_text = [c for c in chunks if c.choices]
    assert with_text and all(c.usage is not None for c in chunks)
    seen = [c.usage.completion_tokens for c in with_text]
    assert seen == sorted(seen) and seen[-1] == chunks[-1].usage.completion_tokens == 12
    assert all(c.usage.prompt_tokens == prompt_tokens and
               c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens
               for c in chunks)
    chat = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        temperature=0, stream=True,
        extra_body={"stream_options": {"include_usage": True,
                                       "continuous_usage_stats": True}}))
    assert all(c.usage is not None for c in chat)
    counts = [c.usage.completion_tokens for c in chat]
    assert counts == sorted(counts) and 1 <= counts[-1] <= 5


def test_a_model_by_id(api_base):
    client = OpenAI(base_url=api_base, api_key="unused")
    assert client.models.retrieve(MODEL).id == MODEL
    response = httpx.get(f"{api_base}/models/no-such-model", timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert json.loads(httpx.get(f"{api_base}/models", timeout=10).text)["data"][0]["id"] == MODEL
