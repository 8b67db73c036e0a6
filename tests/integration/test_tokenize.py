"""POST /tokenize and /detokenize in vLLM's shapes: ids and counts equal transformers'
tokenizer, and tokenize → detokenize gives the text back (as transformers decodes it)."""

from __future__ import annotations

import json

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


def test_template_options_render_alike_in_chat_and_tokenize(http, api_base, hf):
    """vLLM's continue_final_message: the model continues the last (assistant) message."""
    messages = [{"role": "user", "content": "Tell me a story."},
                {"role": "assistant", "content": "Once upon a time"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    # the plain template (router/chat_template.py), cut after the last message's content
    want = hf.encode("<s>User: Tell me a story.\nAssistant: Once upon a time",
                     add_special_tokens=False)
    out = http.post("/tokenize", json={"messages": messages, **options}).json()
    assert out["tokens"] == want
    chat = httpx.post(f"{api_base}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
        "return_token_ids": True, **options}).json()
    assert chat["usage"]["prompt_tokens"] == len(want)
    assert chat["choices"][0]["token_ids"] == hf.greedy(want, 8)
    # vLLM's chat echo: the reply starts with the assistant message it continues
    reply = chat["choices"][0]["message"]["content"]
    for stream in (False, True):
        echoed = httpx.post(f"{api_base}/chat/completions", timeout=60, json={
            "model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
            "echo": True, "stream": stream, **options})
        if stream:
            chunks = [json.loads(line[6:]) for line in echoed.text.splitlines()
                      if line.startswith("data: {")]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        else:
            text = echoed.json()["choices"][0]["message"]["content"]
        assert text == "Once upon a time" + reply
    # no generation prompt: the reply continues the last message in its role (vLLM's)
    user = [{"role": "user", "content": "Once upon a time"}]
    echoed = httpx.post(f"{api_base}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": user, "max_tokens": 4, "echo": True,
        "add_generation_prompt": False}).json()["choices"][0]["message"]
    assert echoed["role"] == "user" and echoed["content"].startswith("Once upon a time")
    both = httpx.post(f"{api_base}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and "add_generation_prompt" in both.text
    # template variables: accepted (the plain template reads none), the server's own refused
    extra = {"chat_template_kwargs": {"enable_thinking": False},
             "documents": [{"title": "A", "text": "cats"}]}
    plain = http.post("/tokenize", json={"messages": messages}).json()
    assert http.post("/tokenize", json={"messages": messages, **extra}).json() == plain
    for path, body in (("/tokenize", {"messages": messages}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": messages})):
        response = http.post(path, json={**body, "chat_template_kwargs": {"messages": []}})
        assert response.status_code == 400 and "chat_template_kwargs" in response.text


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
