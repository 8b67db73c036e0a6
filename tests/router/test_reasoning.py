"""Reasoning parsers split a choice's text the same whether it arrives whole or in any
deltas, and as vLLM's parsers do (vllm/reasoning/basic_parsers.py, deepseek_r1, qwen3)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.router.reasoning import ReasoningParser

TEXTS = ["<think>Let me see.</think>The answer is 4.", "Thinking without a start</think>Done",
         "<think>never finished", "<think>a</think>b</think>c", "\n<think>x</think>",
         "plain <thin k> text </thi", "</think>only content", "a</think></thi</think>nk>b",
         '<think>plan<tool_call>{"name": "f"}</tool_call>']


def whole(parser: ReasoningParser, text: str, **kwargs) -> tuple[str, str]:
    return parser.stream(kwargs).feed(text, final=True)


def vllm_rule(text: str) -> tuple[str, str]:
    """vLLM's extract_reasoning for an output that starts in reasoning: the start marker is
    dropped, reasoning runs to the first end marker (all of it without one). One change:
    text before the start marker stays in the reasoning, as vLLM's deepseek_r1 streams it
    (its whole-output parse drops it; here it is "" or "\n")."""
    before, marker, after = text.partition("<think>")
    reasoning, _, content = (before + after if marker else before).partition("</think>")
    return reasoning, content


@pytest.mark.parametrize("text", [t for t in TEXTS if "<tool_call>" not in t])
def test_deepseek_r1_splits_as_vllm(text):
    assert whole(ReasoningParser("deepseek_r1"), text) == vllm_rule(text)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", TEXTS)
def test_any_deltas_give_the_whole_split(name, text):
    parser = ReasoningParser(name)
    want = whole(parser, text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            stream = parser.stream()
            parts = [stream.feed(piece, final=False) for piece in (text[:i], text[i:j])]
            parts.append(stream.feed(text[j:], final=True))
            assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == want, (i, j)


def test_qwen3_drops_a_late_end_and_obeys_enable_thinking():
    qwen3 = ReasoningParser("qwen3")
    assert whole(qwen3, "<think>a</think>b</think>c") == ("a", "bc")
    assert whole(ReasoningParser("deepseek_r1"), "<think>a</think>b</think>c") == \
        ("a", "b</think>c")
    for off in (False, 0, None):  # vLLM: any false value turns thinking off
        assert whole(qwen3, "no thoughts</think>x", enable_thinking=off) == ("", "no thoughtsx")
    assert whole(qwen3, "no thoughts", enable_thinking=False) == ("", "no thoughts")
    # every <think> in the reasoning goes; a tool call ends the reasoning and is the answer's
    assert whole(qwen3, "<think>x<think>y</think>z") == ("xy", "z")
    call = '<tool_call>{"name": "f"}</tool_call>'
    assert whole(qwen3, "<think>plan" + call) == ("plan", call)
    assert whole(ReasoningParser("deepseek_r1"), "<think>plan" + call) == ("plan" + call, "")


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="deepseek_r1"):
        ReasoningParser("o1")


MARKER_IDS = {"<think>": (1,), "</think>": (2,), "<tool_call>": (3,)}
SPELLING = {1: "<think>", 2: "</think>", 3: "<tool_call>"}


def vllm_count(ids: list[int]) -> int:
    """vLLM's count for thinking parsers (vllm/reasoning/basic_parsers.py
    count_reasoning_tokens): the ids inside start/end marker pairs, markers not counted."""
    count = depth = 0
    for token_id in ids:
        if token_id in (1, 2):
            depth = depth + 1 if token_id == 1 else max(0, depth - 1)
        elif depth:
            count += 1
    return count


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@given(ids=st.lists(st.sampled_from([1, 2, 3, 7, 8]), max_size=12),
       cut=st.integers(0, 12), thinking=st.booleans())
def test_reasoning_token_count_is_the_reasoning_texts_tokens(name, ids, cut, thinking):
    """With single-id markers, the count is the ids whose text the split gives to the
    reasoning (a marker it keeps as text included), however the ids arrive."""
    parser = ReasoningParser(name)
    kwargs = {"enable_thinking": thinking}
    reasoning, _ = whole(parser, "".join(SPELLING.get(i, "x") for i in ids), **kwargs)
    counter = parser.token_count(MARKER_IDS, kwargs)
    counter.feed(ids[:cut])
    assert counter.feed(ids[cut:]) == sum(map(reasoning.count, ["x", *MARKER_IDS]))


@given(ids=st.lists(st.sampled_from([2, 7, 8]), max_size=12))
def test_reasoning_token_count_matches_vllms_after_a_start_marker(ids):
    counter = ReasoningParser("deepseek_r1").token_count(MARKER_IDS)
    assert counter.feed([1] + ids) == vllm_count([1] + ids)


def test_reasoning_token_count_with_markers_of_several_ids():
    markers = {"<think>": (1, 2), "</think>": (3, 4), "<tool_call>": (5, 6)}
    count = ReasoningParser("qwen3").token_count(markers)
    assert count.feed([1, 2, 9, 3]) == 2  # a marker's first id counts until it completes
    assert count.feed([4, 9, 9]) == 1 and not count.in_reasoning
    count = ReasoningParser("qwen3").token_count(markers)
    assert count.feed([9, 3, 9, 5, 6, 9]) == 3 and not count.in_reasoning  # a call ends it
