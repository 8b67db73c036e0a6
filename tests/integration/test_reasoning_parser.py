"""--reasoning-parser on a served chat: the gateway over the session cluster. The bundled
model never writes </think>, so every reply is reasoning (vLLM's rule for an output without
the end marker), a grammar never begins, unless thinking is off; the split itself is
tests/router/test_reasoning.py's, a grammar after the reasoning
tests/engine/test_structured_output.py's."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "stories260K"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def url(reasoning_api_base):
    return reasoning_api_base


def chat(url: str, **fields) -> dict:
    response = httpx.post(f"{url}/chat/completions", json={**CHAT, **fields}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_reply_without_an_end_marker_is_reasoning(url, api_base):
    plain = httpx.post(f"{api_base}/chat/completions", json=CHAT, timeout=60).json()
    text = plain["choices"][0]["message"]["content"]
    assert text and plain["choices"][0]["message"]["reasoning"] is None  # vLLM's: always
    message = chat(url)["choices"][0]["message"]
    assert message["reasoning"] == text and message["content"] is None
    streamed = httpx.post(f"{url}/chat/completions", json={**CHAT, "stream": True},
                          timeout=60).text
    deltas = [line for line in streamed.splitlines() if line.startswith("data: {")]
    parts = [json.loads(line[6:])["choices"][0]["delta"] for line in deltas]
    assert "".join(p.get("reasoning") or "" for p in parts) == text
    assert all(p.get("content") is None for p in parts)


def test_thinking_off_a_grammar_or_include_reasoning_false(url, api_base):
    plain = httpx.post(f"{api_base}/chat/completions", json=CHAT, timeout=60).json()
    text = plain["choices"][0]["message"]["content"]
    for fields in ({"chat_template_kwargs": {"enable_thinking": False}},
                   {"reasoning_effort": "none"}):  # vLLM turns thinking off at "none"
        off = chat(url, **fields)["choices"][0]["message"]
        assert off["content"] == text and off["reasoning"] is None
    low = chat(url, reasoning_effort="low")["choices"][0]["message"]
    assert low["reasoning"] == text and low["content"] is None
    hidden = chat(url, include_reasoning=False)["choices"][0]["message"]
    assert hidden["reasoning"] is None and hidden["content"] is None
    # a grammar holds after the reasoning (which never ends here), as vLLM's
    regex = {"structured_outputs": {"regex": "[a-z]{3}"}}
    shaped = chat(url, **regex)["choices"][0]["message"]
    assert shaped["reasoning"] == text and shaped["content"] is None
    shaped = chat(url, **regex, reasoning_effort="none")["choices"][0]["message"]
    assert len(shaped["content"]) == 3 and shaped["reasoning"] is None


def test_usage_counts_the_reasoning_tokens(url, api_base):
    """vLLM's completion_tokens_details.reasoning_tokens, with a reasoning parser only: here
    every token is reasoning (no end marker), or none with thinking off."""
    usage = chat(url)["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": usage["completion_tokens"]}
    off = chat(url, chat_template_kwargs={"enable_thinking": False})["usage"]
    assert off["completion_tokens_details"] == {"reasoning_tokens": 0}
    n2 = chat(url, n=2, temperature=1.0, seed=3)["usage"]
    assert n2["completion_tokens_details"]["reasoning_tokens"] == n2["completion_tokens"] > 0
    streamed = httpx.post(f"{url}/chat/completions", timeout=60, json={
        **CHAT, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).text
    frames = [json.loads(line[6:]) for line in streamed.splitlines()
              if line.startswith("data: {")]
    last = frames[-1]["usage"]
    assert (last["completion_tokens"], last["completion_tokens_details"]) == \
        (usage["completion_tokens"], usage["completion_tokens_details"])
    assert all(f["usage"]["completion_tokens_details"]["reasoning_tokens"]
               == f["usage"]["completion_tokens"] for f in frames)
    plain = httpx.post(f"{api_base}/chat/completions", json=CHAT, timeout=60).json()["usage"]
    assert "completion_tokens_details" not in plain
