"""The tool-call parsers on crafted outputs: a stream cut anywhere folds to what the whole text
parses to, calls come out name first, and malformed JSON is content."""

from __future__ import annotations

import json

import pytest

from pdcluster.router.tool_parsers import (CallArguments, CallStart, Content, ForcedCalls,
                                           HermesCalls, Llama3JsonCalls)

CASES = [
    (HermesCalls, 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                  '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me look.\n", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (HermesCalls, 'No tools <tool here', "No tools <tool here", []),
    (HermesCalls, '<tool_call>{"name": "f", "arguments": {"a": </tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": </tool_call>', []),
    (Llama3JsonCalls, '{"name": "a", "parameters": {"x": [1, "}"]}}; {"name": "b", '
                      '"parameters": {}}', "", [("a", {"x": [1, "}"]}), ("b", {})]),
    (Llama3JsonCalls, '<|python_tag|>{"name": "a", "parameters": {}}', "", [("a", {})]),
    (Llama3JsonCalls, '{"name": "a", "parameters": ', '{"name": "a", "parameters": ', []),
    (Llama3JsonCalls, 'Plain {text}', "Plain {text}", []),
    (ForcedCalls, '[{"name":"a","parameters":{"s":"}\\",{"}},{"name":"b","parameters":{}}]', "",
     [("a", {"s": '}",{'}), ("b", {})]),
]


def fold(events) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = "", {}
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallStart):
            assert e.index not in calls  # a call starts once, before its arguments
            calls[e.index] = [e.name, ""]
        else:
            assert isinstance(e, CallArguments) and e.index in calls
            calls[e.index][1] += e.fragment
    return content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_any_cut_of_the_stream_folds_to_the_whole_parse(parser, text, content, calls):
    whole = parser()
    assert fold(whole.feed(text) + whole.finish()) == (content, calls)
    for cut in range(len(text) + 1):
        stream = parser()
        assert fold(stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()) == \
            (content, calls), cut
    stream = parser()
    assert fold([e for ch in text for e in stream.feed(ch)] + stream.finish()) == (content, calls)


def test_a_named_choice_streams_its_arguments_as_they_come():
    stream = ForcedCalls("f")
    assert stream.feed('{"a":') == [CallStart(0, "f"), CallArguments(0, '{"a":')]
    assert stream.feed("1}") == [CallArguments(0, "1}")] and stream.finish() == []
