"""Scoring a prompt as evaluation harnesses do (`echo: true, logprobs: 1, max_tokens: 0` on
/v1/completions) and vLLM's `prompt_logprobs` on both endpoints: each prompt token's logprob
equals transformers' log-softmax of the position before it, also when the prompt's prefix is
already cached; best_of keeps the candidates with the highest cumulative logprob."""

from __future__ import annotations

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow

MODEL = "stories260K"
SUBJECTS = ["cat", "dog", "little girl", "boy", "bird", "big tree", "red ball", "fish", "king",
            "frog", "small car", "bear", "cake", "star", "boat", "bunny", "queen", "duck",
            "robot", "whale"]
PROMPTS = [f"Once upon a time, there was a {s} who liked to play in the park." for s in SUBJECTS]


def reference(hf, ids: list[int]) -> list[float]:
    """transformers' log-softmax of each prompt token given the ones before it."""
    logprobs = torch.log_softmax(hf.logits(ids), dim=-1)
    return [float(logprobs[i - 1, t]) for i, t in enumerate(ids) if i]


def score(api_base: str, prompt: str) -> dict:
    response = httpx.post(f"{api_base}/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert response.status_code == 200, response.text
    return response.json()


def check_scores(out: dict, prompt: str, hf) -> None:
    ids = hf.encode(prompt)
    [choice] = out["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = reference(hf, ids)
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want)) < 1e-4
    for top, got in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]):
        assert len(top) == 1 and max(top.values()) >= got - 1e-6  # the most likely one


def test_echoed_prompt_logprobs_equal_transformers_cold_and_cached(api_base, hf):
    for prompt in PROMPTS:
        check_scores(score(api_base, prompt), prompt, hf)
    for prompt in PROMPTS:  # every prompt's blocks are in the prefix cache now
        warm = httpx.post(f"{api_base}/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2}).json()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        check_scores(score(api_base, prompt), prompt, hf)


def test_vllm_prompt_logprobs_on_both_endpoints(api_base, hf):
    prompt = PROMPTS[0]
    ids = hf.encode(prompt)
    want = reference(hf, ids)
    logprobs = torch.log_softmax(hf.logits(ids), dim=-1)
    out = httpx.post(f"{api_base}/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 3, "prompt_logprobs": 2}).json()
    [choice] = out["choices"]
    assert out["usage"]["completion_tokens"] == 3 and choice["prompt_logprobs"][0] is None
    for i, (position, token) in enumerate(zip(choice["prompt_logprobs"][1:], ids[1:]), 1):
        mine = position[str(token)]
        assert abs(mine["logprob"] - want[i - 1]) < 1e-4
        assert mine["rank"] == 1 + int((logprobs[i - 1] > logprobs[i - 1, token]).sum())
        top2 = torch.topk(logprobs[i - 1], 2).indices.tolist()
        assert {str(t) for t in top2} <= set(position) and len(position) <= 3
    chat = httpx.post(f"{api_base}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(p) == 1 for p in chat["prompt_logprobs"][1:])


def test_echo_with_generated_tokens_and_streaming(api_base, hf):
    prompt = PROMPTS[1]
    ids = hf.encode(prompt)
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 4,
            "temperature": 0}
    out = httpx.post(f"{api_base}/completions", timeout=60, json=body).json()
    [choice] = out["choices"]
    generated = hf.decode_output(ids, hf.greedy(ids, 4))
    assert choice["text"] == prompt + generated
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 4
    with httpx.stream("POST", f"{api_base}/completions", timeout=60,
                      json={**body, "stream": True}) as response:
        texts = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert texts[0].count(prompt.split(",")[0]) == 1


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_bad_scoring_requests_are_400s(api_base, body, param):
    response = httpx.post(f"{api_base}/completions", timeout=30, json={
        "model": MODEL, "prompt": "Hi", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(api_base):
    body = {"model": MODEL, "prompt": ["Once upon a time", "The dog"], "max_tokens": 6,
            "temperature": 1.0, "seed": 11, "logprobs": 0}
    every = httpx.post(f"{api_base}/completions", timeout=60, json={**body, "n": 4}).json()
    best = httpx.post(f"{api_base}/completions", timeout=60,
                      json={**body, "n": 2, "best_of": 4}).json()
    assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"] == 48
    for p in range(2):  # the same seeds draw the same candidates: the best two of the four
        ranked = sorted(every["choices"][4 * p:4 * p + 4],
                        key=lambda c: sum(c["logprobs"]["token_logprobs"]), reverse=True)
        assert [c["text"] for c in best["choices"][2 * p:2 * p + 2]] == \
            [c["text"] for c in ranked[:2]]
        assert [c["index"] for c in best["choices"][2 * p:2 * p + 2]] == [2 * p, 2 * p + 1]
    hidden = httpx.post(f"{api_base}/completions", timeout=60, json={
        **{k: v for k, v in body.items() if k != "logprobs"}, "best_of": 3}).json()
    assert len(hidden["choices"]) == 2 and hidden["choices"][0]["logprobs"] is None
