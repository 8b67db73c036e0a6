"""Bad requests get the right 4xx with OpenAI's error body, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow

MODEL = "stories260K"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}

# a value of the wrong JSON type for every field of the two request bodies
WRONG_TYPES = {
    "model": 123, "max_tokens": "many", "temperature": "hot", "top_p": [1], "top_k": "k",
    "min_p": {}, "seed": "s", "n": "two", "stop": 123, "stop_token_ids": "x",
    "ignore_eos": "maybe", "min_tokens": "m", "presence_penalty": "p", "frequency_penalty": [],
    "repetition_penalty": "r", "stream": "perhaps", "stream_options": "x", "user": 1,
    "cache_salt": 1, "return_token_ids": "nah",
}
COMPLETION_ONLY = {"prompt": {"a": 1}, "logprobs": "l"}
CHAT_ONLY = {"messages": "hi", "max_completion_tokens": "x", "logprobs": "x",
             "top_logprobs": "x"}


@pytest.fixture(scope="module")
def http(api_base):
    with httpx.Client(base_url=api_base, timeout=30) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert (error["param"] or "").split(".")[0] == param, error
    return error


@pytest.mark.parametrize("field,value", {**WRONG_TYPES, **COMPLETION_ONLY}.items())
def test_wrong_type_completions(http, field, value):
    assert_error(http.post("/completions", json={**COMPLETION, field: value}), 400, field)


@pytest.mark.parametrize("field,value", {**WRONG_TYPES, **CHAT_ONLY}.items())
def test_wrong_type_chat(http, field, value):
    assert_error(http.post("/chat/completions", json={**CHAT, field: value}), 400, field)


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "max_tokens": 4}, "prompt"),                      # missing prompt
    ({**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ({**COMPLETION, "temperature": -1}, "temperature"),
    ({**COMPLETION, "top_p": 1.5}, "top_p"),
    ({**COMPLETION, "n": 0}, "n"),
    ({**COMPLETION, "prompt": [], }, "prompt"),
    ({**COMPLETION, "prompt": [1, 99999]}, "prompt"),                   # id outside the vocab
    ({**COMPLETION, "min_tokens": 9}, None),                            # min_tokens > max_tokens
    ({**COMPLETION, "unknown_field": 1}, "unknown_field"),
    ({**COMPLETION, "logit_bias": {"five": 1}}, "logit_bias"),         # a key that is no id
    ({**COMPLETION, "logit_bias": {"99999": 1}}, "logit_bias"),         # outside the vocab
    ({**COMPLETION, "logit_bias": {"5": "up"}}, "logit_bias"),
    ({**COMPLETION, "allowed_token_ids": []}, "allowed_token_ids"),     # vLLM refuses it too
    ({**COMPLETION, "allowed_token_ids": [3, 99999]}, "allowed_token_ids"),
    ({**COMPLETION, "bad_words": ["  "]}, "bad_words"),                 # no tokens
    ({**COMPLETION, "bad_words": "dog"}, "bad_words"),
    ({**COMPLETION, "bad_words": ["dog"] * 129}, "bad_words"),          # vLLM's 128 words
    ({**COMPLETION, "bad_words": ["a b c d e f g h i j k l"] * 90}, "bad_words"),  # > 1,024 ids
    ({**COMPLETION, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({**COMPLETION, "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens"),
    ({**COMPLETION, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({**COMPLETION, "truncation_side": "middle"}, "truncation_side"),
])
def test_invalid_completion_values(http, body, param):
    assert_error(http.post("/completions", json=body), 400, param)


def test_prompt_over_the_context_says_by_how_much(http):
    error = assert_error(http.post("/completions", json={**COMPLETION, "prompt": [5] * 500,
                                                         "max_tokens": 20}), 400, "max_tokens")
    assert "8 over the limit" in error["message"]


@pytest.mark.parametrize("body,param", [
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),                      # without logprobs
])
def test_invalid_chat_values(http, body, param):
    assert_error(http.post("/chat/completions", json=body), 400, param)


def test_unknown_model_malformed_json_and_huge_body(http):
    error = assert_error(http.post("/completions", json={**COMPLETION, "model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found"
    assert_error(http.post("/completions", content=b'{"model": "stories260K", "prompt": ',
                           headers={"content-type": "application/json"}), 400)
    big = b'{"model": "stories260K", "prompt": "' + b"a" * (10 << 20) + b'"}'
    assert_error(http.post("/completions", content=big,
                           headers={"content-type": "application/json"}), 413)

    def chunked():
        yield b'{"model": "stories260K", "prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}'

    assert_error(http.post("/completions", content=chunked(),
                           headers={"content-type": "application/json"}), 413)


def test_openai_client_sees_bad_request_and_server_keeps_serving(api_base, http, hf):
    client = OpenAI(base_url=api_base, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                    temperature=0)
    prompt = hf.encode("Once upon a time")
    assert out.choices[0].text == hf.decode_output(prompt, hf.greedy(prompt, 5))
    assert http.get("/models").json()["data"][0]["id"] == MODEL


def test_metrics_cover_requests_rejections_and_prefix_cache(http, api_base):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = httpx.get(api_base.removesuffix("/v1") + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    before = scrape()
    prompt = list(range(3, 3 + 40))  # 2 full blocks + a tail
    for _ in range(2):
        assert http.post("/completions", json={**COMPLETION, "prompt": prompt}).status_code == 200
    http.post("/completions", json={**COMPLETION, "max_tokens": 0})
    after = scrape()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("pdcluster_prompt_tokens_total") == 80
    assert delta("pdcluster_generation_tokens_total") == 8
    assert delta("pdcluster_time_to_first_token_seconds_count") == 2
    assert delta("pdcluster_prefix_cache_queried_tokens_total") == 80
    assert delta("pdcluster_prefix_cache_hit_tokens_total", tier="device") == 32
    assert delta("pdcluster_requests_rejected_total", reason="invalid_request") == 1
    assert delta("pdcluster_kv_transfer_bytes_total", backend="grpc") > 0
    # prompt and reply fill the same 2 full blocks the prefill published: nothing new to publish
    assert delta("pdcluster_kv_published_blocks_total", role="decode", outcome="stored") == 0
