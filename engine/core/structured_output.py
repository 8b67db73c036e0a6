"""Structured output: grammars that constrain sampling (vLLM v1's ``StructuredOutputManager``
over its ``guidance`` backend, llguidance).

A request's grammar (engine.protocol.StructuredOutputSpec) compiles once per distinct spec, on a
thread of its own (the engine loop never waits for a compile), into a matcher that the request
copies. Each step, the token bitmask of every constrained row is computed in one call for the
whole batch and applied to the logits as one tensor op before sampling; the sampled token then
advances the request's matcher.

The matcher's state is a function of the output tokens alone, so it moves with a request: a
decode that receives the prefill's first token, or a migrated request that carries its earlier
output as the prompt's tail (SamplingParams.output_offset), replays those tokens into a fresh
matcher on arrival; preemption keeps the matcher with the request.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import llguidance
# llguidance.numpy, not .torch: the torch module compiles a kernel at import, which loads
# torch._dynamo into every process that imports the engine
import llguidance.numpy as llg_numpy
import torch

from pdcluster.engine.protocol import StructuredOutputSpec
from pdcluster.engine.tokenizer import Tokenizer

#: distinct compiled grammars kept (least recently used go first)
CACHE_SIZE = 256
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
#: JSON is written compact (no whitespace between tokens): a sampled model free to add
#: whitespace can spend every token on it (vLLM's `disable_any_whitespace`, llama.cpp's
#: bounded `ws`); a spec's whitespace_pattern overrides
_JSON_LAYOUT = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The spec is not a grammar llguidance can compile; the message says what is wrong."""


def grammar_of(spec: StructuredOutputSpec) -> str:
    """llguidance's grammar text for ``spec``. Raises GrammarError when the spec does not
    parse (bad JSON, a GBNF grammar that does not convert)."""
    try:
        if spec.kind == "structural_tag":
            return _structural_tag(json.loads(spec.spec))
        if spec.kind == "json":
            overrides = ({"whitespace_pattern": spec.whitespace_pattern}
                         if spec.whitespace_pattern is not None else None)
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.loads(spec.spec), defaults=_JSON_LAYOUT, overrides=overrides)
        return llguidance.grammar_from(spec.kind, spec.spec)
    except (ValueError, TypeError, KeyError, AssertionError) as exc:
        raise GrammarError(f"invalid {spec.kind}: {exc}") from None


def _structural_tag(tag: dict) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}):
    free text in which each structure, once its trigger appears, is held to its schema."""
    triggers = tag["triggers"]
    tags = []
    for s in tag["structures"]:
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger begins {s['begin']!r}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"],
                                         grammar=s.get("schema") or {}, end=s["end"]))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


class _LosslessTokenizer:
    """The model's tokenizer as llguidance's TokenizerWrapper reads it: each token's bytes
    (engine.tokenizer.Tokenizer.token_bytes) and an encoder whose ids decode back to exactly
    the text given. llguidance tokenizes the bytes a grammar forces and trusts the ids to hold
    them; a SentencePiece encoder drops a leading space (its dummy prefix), and the mask then
    allows tokens that consuming refuses. Such text is tokenized greedily over the token bytes
    instead."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size)
                                  if tokenizer.is_special(i)]
        self._greedy = llguidance.LLTokenizer(tokenizer.to_json())

    def __call__(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if b"".join(self.tokens[i] for i in ids) == text.encode():
            return ids
        return self._greedy.greedy_tokenize(text)


class StructuredOutputManager:
    """Compiles, caches and applies grammars for one model.

    tokenizer: the model's; vocab_size: the logits' width (ids the tokenizer lacks are never
    allowed); eos_token_ids: what a finished grammar allows (the model's EOS ids; empty: the
    tokenizer's).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_LosslessTokenizer(tokenizer)), n_vocab=vocab_size,
            eos_token=list(eos_token_ids) or None)
        self._compiled: OrderedDict[StructuredOutputSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._executor = llguidance.LLExecutor()

    def validate(self, spec: StructuredOutputSpec) -> None:
        """Raises GrammarError naming the problem when ``spec`` does not compile."""
        error = llguidance.LLMatcher.validate_grammar(grammar_of(spec), self.tokenizer)
        if error:
            raise GrammarError(f"invalid {spec.kind}: {error}")

    def compile(self, spec: StructuredOutputSpec) -> Future:
        """A future of a fresh matcher for ``spec`` (compiled once per spec, off the caller's
        thread); it fails with GrammarError when the spec does not compile."""
        with self._lock:
            template = self._compiled.get(spec)
            if template is None or (template.done() and template.exception() is not None):
                template = self._compiler.submit(self._compile, spec)
                self._compiled[spec] = template
            self._compiled.move_to_end(spec)
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        matcher: Future = Future()

        def copy(done: Future) -> None:
            error = done.exception()
            if error is not None:
                matcher.set_exception(error)
            else:
                matcher.set_result(done.result().deep_copy())

        template.add_done_callback(copy)
        return matcher

    def _compile(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_of(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {matcher.get_error()}")
        return matcher

    def bitmask(self, matchers: Sequence[llguidance.LLMatcher | None]) -> torch.Tensor | None:
        """The allowed-token bitmask of a batch, int32 [rows, ceil(vocab / 32)] (bit j of
        word w allows id 32w + j; rows without a matcher allow everything), computed for all
        constrained rows in one call; None when no row has a matcher."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        mask = torch.full(llg_numpy.get_bitmask_shape(len(matchers), self.vocab_size), -1,
                          dtype=torch.int32)
        llg_numpy.fill_next_token_bitmask_par(self._executor, rows, mask.numpy())
        return mask

    def close(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, each logit its row's bitmask disallows.

    logits: [rows, vocab] float; bitmask: int32 [rows, ceil(vocab / 32)] (any device).
    """
    rows, vocab = logits.shape
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> _BIT_SHIFTS.to(logits.device)) & 1
    allowed = bits.view(rows, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
