"""POST /tokenize and /detokenize in vLLM's shapes: ids and counts equal transformers'
tokenizer, and tokenize → detokenize gives the text back (as transformers decodes it)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "stories260K"
TEXTS = ["Once upon a time", "two  spaces and\nnew lines\n\n and\ttabs",
         "Ünïcödé: café, naïve, 東京, emoji 🐱"]


@pytest.fixture(scope="module")
def http(api_base):
    with httpx.Client(base_url=api_base.removesuffix("/v1"), timeout=30) as client:
        yield client


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_then_detokenize_round_trips_and_counts_equal_transformers(http, hf, text):
    out = http.post("/tokenize", json={"model": MODEL, "prompt": text,
                                       "return_token_strs": True}).json()
    assert out["tokens"] == hf.encode(text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] > 0
    assert out["token_strs"] == hf.tokenizer.convert_ids_to_tokens(out["tokens"])
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == hf.encode(text, add_special_tokens=False)
    assert bare["token_strs"] is None
    back = http.post("/detokenize", json={"model": MODEL, "tokens": out["tokens"]}).json()
    assert back == {"prompt": hf.tokenizer.decode(out["tokens"], skip_special_tokens=True)}
    # this tokenizer's normalizer folds runs of spaces; everything else comes back as sent
    assert back["prompt"] == text.replace("  ", " ")


def test_chat_messages_are_tokenized_as_a_chat_completion_would_be(http, api_base):
    messages = [{"role": "system", "content": "Be kind."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                             {"type": "text", "text": "there"}]}]
    out = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    chat = httpx.post(f"{api_base}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert out["count"] == chat["usage"]["prompt_tokens"] == len(out["tokens"])
    without = http.post("/tokenize", json={"messages": messages,
                                           "add_generation_prompt": False}).json()
    assert without["count"] < out["count"]


@pytest.mark.parametrize("path, body, status, words", [
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "image_url"),
    ("/tokenize", {"model": MODEL}, 400, "exactly one"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": [{"role": "user",
                                                               "content": "b"}]}, 400,
     "exactly one"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "other"),
    ("/detokenize", {"model": MODEL, "tokens": [1, 99999]}, 400, "99999"),
    ("/detokenize", {"model": MODEL, "tokens": [4294967296]}, 400, "4294967296"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens"),
])
def test_bad_inputs_get_an_openai_error_body(http, path, body, status, words):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] or words == error["param"], error
