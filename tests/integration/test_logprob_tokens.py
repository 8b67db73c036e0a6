"""Logprob token strings, bytes and text offsets through the real gateway and workers.

Expected token strings come from transformers' pieces of the returned token ids ("▁" is a
space; a `<0xNN>` byte-fallback piece is that byte, shown as `bytes:\\xNN` unless ASCII).
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

MODEL = "stories260K"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def http(api_base):
    with httpx.Client(base_url=api_base, timeout=120) as client:
        yield client


def expected_token(hf, token_id: int) -> tuple[str, bytes]:
    """(API string, bytes) of a token from transformers' piece."""
    piece = hf.tokenizer.convert_ids_to_tokens(token_id)
    if token_id in hf.tokenizer.all_special_ids:
        return piece, piece.encode()
    byte = re.fullmatch(r"<0x([0-9A-F]{2})>", piece)
    if byte:
        value = int(byte.group(1), 16)
        return (chr(value) if value < 0x80 else f"bytes:\\x{value:02x}"), bytes([value])
    text = piece.replace("▁", " ")
    return text, text.encode()


def completion(http, **body) -> dict:
    r = http.post("/completions", json={"model": MODEL, "prompt": PROMPT, "return_token_ids": True,
                                        **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(http, url: str, **body) -> list[dict]:
    chunks = []
    with http.stream("POST", url, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return [c for c in chunks if c["choices"]]


def offsets_from_lengths(tokens: list[str]) -> list[int]:
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return offsets


def test_completion_tokens_concatenate_to_text(http, hf):
    out = completion(http, max_tokens=20, temperature=0, logprobs=1)
    choice = out["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert lp["tokens"] == [expected_token(hf, i)[0] for i in choice["token_ids"]]
    assert "".join(lp["tokens"]) == text == hf.decode_output(hf.encode(PROMPT),
                                                               choice["token_ids"])
    assert lp["text_offset"] == offsets_from_lengths(lp["tokens"])
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert text[offset:offset + len(token)] == token
    # greedy: the most likely token is the one chosen, under the same string
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]


def test_completion_stream_has_the_same_tokens_and_offsets(http):
    body = dict(prompt=PROMPT, max_tokens=20, temperature=0, logprobs=1)
    whole = completion(http, **body)["choices"][0]
    chunks = stream(http, "/completions", **body)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == whole["logprobs"]["tokens"]
    assert offsets == whole["logprobs"]["text_offset"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


def test_chat_entries_carry_token_strings_and_bytes(http, hf):
    r = http.post("/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 20, "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [(e["token"], bytes(e["bytes"])) for e in content] == \
        [expected_token(hf, i) for i in choice["token_ids"]]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for entry in content:
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        for top in [entry, *entry["top_logprobs"]]:
            if not top["token"].startswith("bytes:"):
                assert bytes(top["bytes"]) == top["token"].encode()


def byte_fallback_run(http, hf, url: str, body: dict) -> tuple[dict, dict]:
    """(request body with its seed, response) of the first seeded run whose output has a
    byte-fallback token above 0x7F. A seed fixes the sampled tokens, so the run reproduces;
    the temperature is high because this model gives byte tokens little probability."""
    for seed in range(20):
        r = http.post(url, json={**body, "seed": seed})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids = choice["token_ids"]
        if any(expected_token(hf, i)[0].startswith("bytes:") for i in ids):
            return {**body, "seed": seed}, r.json()
    pytest.fail("no seed in 20 gave byte-fallback output")


def test_byte_fallback_output_tokens(http, hf):
    body = {"model": MODEL, "prompt": "日本語 café 🙂", "max_tokens": 32, "temperature": 10.0,
            "logprobs": 3, "return_token_ids": True}
    body, out = byte_fallback_run(http, hf, "/completions", body)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [expected_token(hf, i)[0] for i in choice["token_ids"]]
    chunks = stream(http, "/completions", **{k: v for k, v in body.items() if k != "model"})
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == lp["tokens"]
    assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == \
        lp["text_offset"]
    assert all(re.fullmatch(r"bytes:\\x[0-9a-f]{2}", t) or "\ufffd" not in t
               for top in lp["top_logprobs"] for t in top)

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "日本語 café 🙂"}],
            "max_tokens": 32, "temperature": 10.0, "logprobs": True, "top_logprobs": 3,
            "return_token_ids": True}
    _, out = byte_fallback_run(http, hf, "/chat/completions", chat)
    choice = out["choices"][0]
    assert [(e["token"], bytes(e["bytes"])) for e in choice["logprobs"]["content"]] == \
        [expected_token(hf, i) for i in choice["token_ids"]]
    for entry in choice["logprobs"]["content"]:
        for top in entry["top_logprobs"]:
            if top["token"].startswith("bytes:"):
                assert top["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in top["bytes"])
            else:
                assert bytes(top["bytes"]) == top["token"].encode()
