"""Stop strings and stop tokens over incrementally detokenized text (OpenAI `stop`, vLLM
semantics).

The returned text excludes the stop string and everything after it, or with vLLM's
`include_stop_str_in_output` ends after the stop string. A stop string can be split across
tokens, so while streaming (and the stop string is excluded) the last len(longest stop) - 1
characters are held back until it is clear they do not start a stop string (vLLM's
detokenizer does the same).
"""

from __future__ import annotations

from typing import AbstractSet, Sequence

from pdcluster.engine.protocol import SamplingParams
from pdcluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], include_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_in_output = include_in_output
        self._overlap = max((len(s) for s in self.stops), default=1) - 1
        self._holdback = 0 if include_in_output else self._overlap
        self._emitted = 0
        self.stopped: str | None = None  # the stop string found

    def update(self, text: str, final: bool, searched_from: int = 0) -> str:
        """text: the whole output text so far; searched_from: a stop string must end after
        this many characters (vLLM ignores stop strings within the first min_tokens tokens'
        text). Returns the newly releasable text.

        After a stop string is found, `stopped` holds it and later calls return "".
        """
        if self.stopped is not None:
            return ""
        start = max(0, self._emitted - self._overlap)
        hits = [(i, s) for s in self.stops
                if (i := text.find(s, max(start, searched_from - len(s) + 1))) >= 0]
        if hits:  # the one complete first (vLLM checks after each token), then list order
            end, self.stopped = min(hits, key=lambda hit: hit[0] + len(hit[1]))
            if self.include_in_output:
                end += len(self.stopped)
        else:
            end = len(text) if final else max(self._emitted, len(text) - self._holdback)
        delta = text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta


class ChoiceText:
    """The text of one choice as vLLM's detokenizer makes it (vllm/v1/engine/detokenizer.py):
    incrementally detokenized output ids, cut at the first stop string that ends after the
    first min_tokens tokens' text; the EOS or stop_token_ids token that ends the choice adds
    no text unless include_in_output.

    eos_token_ids: the model's. The engine ends a choice at those (unless ignore_eos) and at
    the request's stop_token_ids; the sampler masks them before min_tokens, so any of them in
    the output is its last token.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
                 stops: Sequence[str], eos_token_ids: AbstractSet[int],
                 include_in_output: bool = False, skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stops = StopStringMatcher(stops, include_in_output)
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos
                                                       else set(eos_token_ids))
        self._params, self._include = params, include_in_output
        self._num_tokens = 0
        self._protected = 0  # text of the first min_tokens tokens, where no stop string ends
        self.stop_token: int | None = None

    @property
    def stop_string(self) -> str | None:
        return self._stops.stopped

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's: the stop string found, else the stop_token_ids id that ended the choice;
        None at EOS."""
        if self._stops.stopped is not None:
            return self._stops.stopped
        return self.stop_token if self.stop_token in self._params.stop_token_ids else None

    def add(self, token_ids: Sequence[int], final: bool) -> str:
        """Appends output ids; returns the newly releasable text ("" once a stop string was
        found). final: the choice ended."""
        shown = list(token_ids)
        if shown and shown[-1] in self._stop_ids:
            self.stop_token = shown[-1]
            if not self._include:
                shown.pop()
        head = max(0, min(len(shown), self._params.min_tokens - self._num_tokens))
        self._num_tokens += len(token_ids)
        if head:
            self._detok.add(shown[:head])
            self._protected = len(self._detok.text)
        self._detok.add(shown[head:], final=final or self.stop_token is not None)
        return self._stops.update(self._detok.text, final, self._protected)
