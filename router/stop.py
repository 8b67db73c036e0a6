"""Stop strings over incrementally detokenized text (OpenAI `stop`, vLLM semantics).

The returned text excludes the stop string and everything after it. A stop string can be split
across tokens, so while streaming the last len(longest stop) - 1 characters are held back until
it is clear they do not start a stop string (vLLM's StopChecker does the same).
"""

from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._holdback = max((len(s) for s in self.stops), default=1) - 1
        self._emitted = 0
        self.stopped = False

    def update(self, text: str, final: bool) -> str:
        """text: the whole output text so far. Returns the newly releasable text.

        After a stop string is found, `stopped` is True and later calls return "".
        """
        if self.stopped:
            return ""
        start = max(0, self._emitted - self._holdback)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            self.stopped = True
        else:
            end = len(text) if final else max(self._emitted, len(text) - self._holdback)
        delta = text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta
