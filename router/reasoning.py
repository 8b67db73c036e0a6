"""Reasoning parsers (vLLM's `--reasoning-parser`): a reasoning model's thinking, between
`<think>` and `</think>`, goes to a chat message's `reasoning` field and the rest to its
`content`, streamed or whole (vLLM's `reasoning`, formerly `reasoning_content`).

- `deepseek_r1`: the output starts in reasoning whether or not the model writes `<think>`
  (DeepSeek-R1's template puts it in the prompt); reasoning ends at `</think>`.
- `qwen3`: the same, unless the request's `chat_template_kwargs` turn thinking off
  (`enable_thinking` false): then every token is content. Every `<think>` in the reasoning
  and every `</think>` after it is dropped, and a `<tool_call>` ends the reasoning too: the
  call is the answer's (vllm/parser/qwen3.py).

Output without an end is all reasoning, as in vLLM. `ReasoningTokenCount` counts a choice's
reasoning tokens on its ids for the usage (vLLM's `completion_tokens_details`). Text before `<think>` stays in the
reasoning (vLLM streams it so; its whole-reply parse drops it). The markers are matched on
text, so a tokenizer that spells them in several tokens is served too; a marker's first
characters at the end of a delta wait for the next.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END, TOOL_CALL = "<think>", "</think>", "<tool_call>"


@dataclass(frozen=True)
class ReasoningParser:
    """name: one of REASONING_PARSERS. Raises ValueError for another."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, "
                             f"got {self.name!r}")

    def thinks(self, chat_template_kwargs: dict | None = None) -> bool:
        """Whether the output starts in reasoning (qwen3: unless enable_thinking is false)."""
        return self.name != "qwen3" or bool((chat_template_kwargs or {}).get("enable_thinking",
                                                                             True))

    def stream(self, chat_template_kwargs: dict | None = None) -> ReasoningStream:
        """The splitter of one choice's text."""
        return ReasoningStream(self.thinks(chat_template_kwargs), qwen3=self.name == "qwen3")

    def token_count(self, marker_ids: dict[str, tuple[int, ...]],
                    chat_template_kwargs: dict | None = None) -> ReasoningTokenCount:
        """The reasoning-token counter of one choice; marker_ids: the tokenizer's ids of
        THINK_START, THINK_END and TOOL_CALL (each non-empty)."""
        return ReasoningTokenCount(marker_ids, self.thinks(chat_template_kwargs),
                                   qwen3=self.name == "qwen3")


class ReasoningStream:
    """One choice's output text split into reasoning and content as it arrives; qwen3:
    vllm/parser/qwen3.py's extra rules (module docstring)."""

    def __init__(self, thinking: bool, qwen3: bool = False) -> None:
        self.in_reasoning = thinking
        self._qwen3 = qwen3
        self._started = False  # a start marker was dropped
        self._pending = ""  # text that may begin a marker

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The (reasoning, content) text that `text` releases; final: the choice ended."""
        buf, reasoning, content = self._pending + text, "", ""
        while self.in_reasoning and buf:
            markers = [THINK_END] + ([THINK_START] if self._qwen3 or not self._started else [])
            markers += [TOOL_CALL] if self._qwen3 else []
            at, marker = _first(buf, markers)
            if marker is None:
                keep = 0 if final else _marker_prefix(buf, markers)
                reasoning, buf = reasoning + buf[:len(buf) - keep], buf[len(buf) - keep:]
                break
            reasoning += buf[:at]
            if marker == THINK_START:
                buf, self._started = buf[at + len(THINK_START):], True
            else:  # the end, or (qwen3) a tool call, which the answer keeps
                buf = buf[at + len(THINK_END):] if marker == THINK_END else buf[at:]
                self.in_reasoning = False
        while not self.in_reasoning and buf:
            at, marker = _first(buf, [THINK_END] if self._qwen3 else [])
            if marker is None:
                keep = 0 if final or not self._qwen3 else _marker_prefix(buf, [THINK_END])
                content, buf = content + buf[:len(buf) - keep], buf[len(buf) - keep:]
                break
            content, buf = content + buf[:at], buf[at + len(THINK_END):]
        self._pending = buf
        return reasoning, content


class ReasoningTokenCount:
    """One choice's reasoning tokens, counted on its ids as they arrive: those generated while
    the reasoning is open, its markers not counted, by ReasoningStream's rules (so an output
    without an end is all reasoning). vLLM reports the same count as
    `usage.completion_tokens_details.reasoning_tokens` (its thinking parsers count between
    the marker ids)."""

    def __init__(self, marker_ids: dict[str, tuple[int, ...]], thinking: bool,
                 qwen3: bool = False) -> None:
        self.in_reasoning = thinking
        self._markers = marker_ids
        self._qwen3 = qwen3
        self._started = False
        self._recent: list[int] = []  # the last ids, as long as the longest marker
        self._longest = max(map(len, marker_ids.values()))
        self.count = 0

    def feed(self, token_ids: list[int]) -> int:
        """Counts `token_ids` (the choice's next ids); returns the count so far."""
        for token_id in token_ids:
            if not self.in_reasoning:
                break
            self.count += 1
            self._recent = (self._recent + [token_id])[-self._longest:]
            marker = self._ended_marker()
            if marker is None:
                continue
            self.count -= len(self._markers[marker])
            self._recent = []
            if marker == THINK_START:
                self._started = True
            else:
                self.in_reasoning = False
        return self.count

    def _ended_marker(self) -> str | None:
        markers = [THINK_END] + ([THINK_START] if self._qwen3 or not self._started else [])
        markers += [TOOL_CALL] if self._qwen3 else []
        for marker in markers:
            ids = self._markers[marker]
            if tuple(self._recent[-len(ids):]) == ids:
                return marker
        return None


def _first(text: str, markers: list[str]) -> tuple[int, str | None]:
    """Where the first of markers in text starts, and which it is ((-1, None): none)."""
    hits = [(at, m) for m in markers if (at := text.find(m)) >= 0]
    return min(hits) if hits else (-1, None)


def _marker_prefix(text: str, markers: list[str]) -> int:
    """How many of text's last characters begin one of markers (0: none)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0
