"""A chat choice as the gateway writes it, delta by delta (router.chat._choice): reasoning
then an answer with a tool call, reasoning hidden by include_reasoning false, and vLLM's echo
and reply role. The deltas are the gateway's own ChoiceDelta; no engine runs."""

from __future__ import annotations

import json

import pytest

from pdcluster.engine.config import BUNDLED_MODEL
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.chat import _choice, _ChoiceState
from pdcluster.router.reasoning import ReasoningParser
from pdcluster.router.schemas import ChatCompletionRequest
from pdcluster.router.serving import ChoiceDelta
from pdcluster.router.tool_calls import ToolCalling, plan

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
PIECES = ["<think>", "I should", " add.</th", "ink>Sure.<tool_call>", '{"name": "add", ',
          '"arguments": {"a": 1}}', "</tool_call>"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(BUNDLED_MODEL)


def run(tokenizer, body: ChatCompletionRequest, pieces: list[str], **state) -> list[dict]:
    tools = plan(body.tools, body.tool_choice, body.parallel_tool_calls,
                 ToolCalling("hermes", True))
    choice = _ChoiceState(tools, **state)
    return [_choice(ChoiceDelta(0, text, [7], finish_reason="stop" if i == len(pieces) - 1
                                else None), body, tokenizer, choice)
            for i, text in enumerate(pieces)]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "1+?"}],
                                 **fields)


def test_streamed_reasoning_then_answer_then_call(tokenizer):
    body = request(stream=True, tools=TOOLS, return_token_ids=True, logprobs=False)
    chunks = [c["delta"] for c in run(tokenizer, body, PIECES,
                                      reasoning=ReasoningParser("qwen3").stream())]
    assert chunks[0]["role"] == "assistant"
    assert "".join(c.get("reasoning") or "" for c in chunks) == "I should add."
    assert "".join(c.get("content") or "" for c in chunks) == "Sure."
    calls = [call for c in chunks for call in c.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "add"
    args = "".join(call["function"].get("arguments") or "" for call in calls)
    assert json.loads(args) == {"a": 1}


def test_whole_reply_hidden_reasoning_shows_nowhere(tokenizer):
    text = "".join(PIECES[:3]) + "ink>Sure."
    shown = run(tokenizer, request(return_token_ids=True), [text],
                reasoning=ReasoningParser("qwen3").stream())[0]
    assert shown["message"]["reasoning"] == "I should add." and shown["token_ids"] == [7]
    hidden = run(tokenizer, request(return_token_ids=True, include_reasoning=False), [text],
                 reasoning=ReasoningParser("qwen3").stream())[0]
    assert hidden["message"] == {"role": "assistant", "content": "Sure.", "reasoning": None}
    assert "token_ids" not in hidden and hidden["logprobs"] is None
    streamed = run(tokenizer, request(stream=True, include_reasoning=False), PIECES[:4],
                   reasoning=ReasoningParser("qwen3").stream())
    assert all("reasoning" not in c["delta"] for c in streamed)


def test_echo_starts_each_choice_with_the_last_message_of_the_reply_role(tokenizer):
    body = request(echo=True, stream=True)
    for role, echo in (("assistant", "Once"), ("user", "1+?")):
        chunks = [run(tokenizer, body, [" upon", " a time"], role=role, echo=echo)
                  for _ in range(2)]  # n = 2: each choice echoes once
        for chunk in chunks:
            assert chunk[0]["delta"]["role"] == role
            assert "".join(c["delta"]["content"] for c in chunk) == echo + " upon a time"
