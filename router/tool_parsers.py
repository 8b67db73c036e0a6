"""Tool calls read out of a model's text, streamed or whole (vLLM's `--tool-call-parser`).

Each parser is a stream: text goes in as it is generated and events come out, so a streamed
choice emits a call's name as soon as it is known and its arguments after it, as OpenAI's
stream does; a whole choice is the same stream fed once. Text that does not parse as a call
(malformed JSON) comes back as content, never as an error.

* ``hermes`` (Qwen2.5/Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, any number, after optional content.
* ``llama3_json`` (Llama 3.1+ JSON tool calling): the whole output is ``{"name": ...,
  "parameters": {...}}`` objects separated by ``;``, optionally after ``<|python_tag|>``.
* ``ForcedCalls``: what tool_choice ``required`` or a named function constrains the output to
  (router.tool_calls): a JSON array of ``{"name", "parameters"}``, or the named function's
  arguments alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    """Call ``index`` of the choice begins: its name (arguments follow)."""

    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    """A fragment of call ``index``'s arguments (JSON text; fragments concatenate)."""

    index: int
    fragment: str


Event = Content | CallStart | CallArguments


class ToolCallStream:
    """Text in, events out. feed(text) returns what can be said so far; finish() the rest."""

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def _call(self, name: str, arguments: str) -> list[Event]:
        self.num_calls += 1
        return [CallStart(self.num_calls - 1, name), CallArguments(self.num_calls - 1, arguments)]


def _call_of(obj, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a parsed call object, None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        return obj["name"], arguments
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could begin ``marker`` (kept until known)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesCalls(ToolCallStream):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(self.START)
                if start < 0:
                    keep = 0 if final else _held_back(self._buffer, self.START)
                    text, self._buffer = (self._buffer[:len(self._buffer) - keep],
                                          self._buffer[len(self._buffer) - keep:])
                    if text:
                        events.append(Content(text))
                    return events
                if start:
                    events.append(Content(self._buffer[:start]))
                self._buffer = self._buffer[start + len(self.START):]
                self._in_call = True
            end = self._buffer.find(self.END)
            if end < 0 and not final:
                return events
            block = self._buffer if end < 0 else self._buffer[:end]
            closed = "" if end < 0 else self.END
            self._buffer = "" if end < 0 else self._buffer[end + len(self.END):]
            self._in_call = False
            try:
                call = _call_of(json.loads(block), "arguments")
            except ValueError:
                call = None
            events += (self._call(*call) if call is not None
                       else [Content(self.START + block + closed)])
            if end < 0:
                return events


class Llama3JsonCalls(ToolCallStream):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._calls: bool | None = None  # undecided until the output's first characters

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        if self._calls is None:
            head = self._buffer.lstrip()
            if not head or (self.PYTHON_TAG.startswith(head) and head != self.PYTHON_TAG):
                return []
            self._calls = head.startswith(("{", self.PYTHON_TAG))
        if self._calls:
            return []  # a call is known once its JSON is whole: at the end
        text, self._buffer = self._buffer, ""
        return [Content(text)] if text else []

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        if not self._calls:
            return [Content(text)] if text else []
        calls = _json_objects(text.strip().removeprefix(self.PYTHON_TAG))
        if calls is None:
            return [Content(text)]
        return [e for call in calls for e in self._call(*call)]


def _json_objects(text: str) -> list[tuple[str, str]] | None:
    """The calls of ``{...}; {...}``, None if any part is not one."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return calls or None
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call_of(obj, "parameters")
        if call is None:
            return None
        calls.append(call)


#: the start of one element of a tool_choice "required" array (after the end of the one
#: before), up to its parameters' value
_ELEMENT = re.compile(r'\s*\}?\s*[\[,]\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                      r'"parameters"\s*:\s*')


class ForcedCalls(ToolCallStream):
    """The output a forced tool choice's grammar allows. named: the function's name (the
    output is its arguments); None: a JSON array of {"name", "parameters"} (required)."""

    def __init__(self, named: str | None = None) -> None:
        super().__init__()
        self._named = named
        self._text = ""
        self._at = 0  # how far the array has been read
        self._value_start: int | None = None  # where the open call's arguments began
        self._scan = _ValueScan()

    def feed(self, text: str) -> list[Event]:
        self._text += text
        if self._named is not None:
            events: list[Event] = [] if self.num_calls else [CallStart(0, self._named)]
            self.num_calls = 1
            return events + ([CallArguments(0, text)] if text else [])
        events = []
        while True:
            if self._value_start is None:
                match = _ELEMENT.match(self._text, self._at)
                if match is None:
                    return events
                self.num_calls += 1
                events.append(CallStart(self.num_calls - 1, json.loads(f'"{match.group(1)}"')))
                self._value_start = self._at = match.end()
                self._scan = _ValueScan()
            end = self._scan.feed(self._text, self._at)
            stop = len(self._text) if end is None else end
            if stop > self._at:
                events.append(CallArguments(self.num_calls - 1, self._text[self._at:stop]))
            self._at = stop
            if end is None:
                return events
            self._value_start = None

    def finish(self) -> list[Event]:
        if self._named is not None:
            return [] if self.num_calls else self.feed("")
        if self.num_calls:
            return []
        # the grammar's layout did not hold (say, parameters before name): parse it whole
        try:
            calls = [_call_of(c, "parameters") for c in json.loads(self._text)]
        except (ValueError, TypeError):
            calls = [None]
        if not calls or None in calls:
            return [Content(self._text)] if self._text else []
        return [e for call in calls for e in self._call(*call)]


class _ValueScan:
    """Finds where a JSON value ends, fed a growing text: tracks nesting and strings."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = self.started = False

    def feed(self, text: str, at: int) -> int | None:
        """The index just past the value, or None if it has not ended by the end of text."""
        for i in range(at, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if ch in " \t\r\n" and not self.started:
                continue
            self.started = True
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif self.depth == 0 and ch in ",}":
                return i
        return None


PARSERS: dict[str, type[ToolCallStream]] = {"hermes": HermesCalls,
                                            "llama3_json": Llama3JsonCalls}
