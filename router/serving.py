"""Turns one API request into choice streams: n choices per prompt, each a pipeline run, with
incremental detokenization and stop strings applied, merged into one stream of ChoiceDelta.

Every exit path — a stop string, the client going away, an error in a sibling choice, a drain
that ran out of time — closes the choice's pipeline generator, which aborts the request on its
worker (no held blocks). Each choice holds its slot of the InflightGate from the moment the
gate grants it until the choice ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from pdcluster.engine.protocol import FinishReason, SamplingParams, TokenLogprob
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.inflight import InflightGate, Overloaded
from pdcluster.router.metrics import GatewayMetrics
from pdcluster.router.pipeline import GenerationError, Pipeline
from pdcluster.router.stop import ChoiceText


@dataclass(frozen=True)
class ChoiceSpec:
    """One choice to generate: `index` is its position in the response's choices;
    prompt_only: it reports the prompt's logprobs and no output (max_tokens 0);
    include_stop_str_in_output, skip_special_tokens: vLLM's (the text of the stop string, or
    of the EOS or stop_token_ids token that ended the choice, is kept; special tokens'
    text is dropped)."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    stops: Sequence[str] = ()
    prompt_only: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass
class ChoiceDelta:
    """New output of one choice. finish_reason: None, "stop" or "length" (OpenAI's values).
    stop_reason (vLLM's): with finish_reason "stop", the stop string or the stop_token_ids
    id that ended the choice; None at EOS, a complete grammar and otherwise.
    num_cached_tokens: on the choice's first delta, the prompt tokens the prefix cache
    served; None on the others. prompt_logprobs: on the first delta, with the params'
    prompt_logprobs, one entry per prompt token after the first."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None


_DONE = object()
log = logging.getLogger(__name__)


class GenerationService:
    """Runs requests' choices on the pipeline, bounded by `gate` (default: unbounded)."""

    def __init__(self, pipeline: Pipeline, tokenizer: Tokenizer,
                 metrics: GatewayMetrics | None = None,
                 gate: InflightGate | None = None,
                 eos_token_ids: frozenset[int] | None = None) -> None:
        """eos_token_ids: the model's (ModelConfig.eos_token_ids; default: the tokenizer's)."""
        self.pipeline = pipeline
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else frozenset(
            t for t in (tokenizer.eos_token_id,) if t is not None)
        self.metrics = metrics or GatewayMetrics()
        self.gate = gate or InflightGate(None)
        self._active: set[asyncio.Queue] = set()

    def abort_all(self, message: str) -> int:
        """Ends every running stream with GenerationError(message, 503) (the SSE error event
        a drain past its deadline sends). Returns how many streams were running."""
        for queue in self._active:
            queue.put_nowait(GenerationError(message, 503))
        return len(self._active)

    async def stream(self, request_id: str, specs: Sequence[ChoiceSpec],
                     cache_salt: str | None = None) -> AsyncIterator[ChoiceDelta]:
        """Merged deltas of all choices. Raises Overloaded (router.inflight) before anything
        starts when the gate refuses the request, at once or while it is queued;
        GenerationError from any choice or from abort_all. Each choice waits for its own slot
        of the gate before it starts."""
        ticket = self.gate.open(len(specs), specs[0].params.priority)
        queue: asyncio.Queue = asyncio.Queue()
        self._active.add(queue)
        queued_at = time.perf_counter()

        async def pump(spec: ChoiceSpec) -> None:
            acquired = False
            try:
                await ticket.acquire()
                acquired = True
                self.metrics.queue_time.observe(time.perf_counter() - queued_at)
                async for delta in self._choice(request_id, spec, cache_salt):
                    await queue.put(delta)
            except (GenerationError, Overloaded) as exc:  # Overloaded: refused while queued
                await queue.put(exc)
            except Exception:  # noqa: BLE001 — a bug must end the stream, not hang it
                log.exception("choice %d of %s failed", spec.index, request_id)
                await queue.put(GenerationError("internal error", 500))
            finally:
                if acquired:
                    ticket.release()
                await queue.put(_DONE)

        tasks = [asyncio.create_task(pump(spec)) for spec in specs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, (GenerationError, Overloaded)):
                    raise item
                else:
                    yield item
        finally:
            self._active.discard(queue)
            try:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                ticket.close()

    async def _choice(self, request_id: str, spec: ChoiceSpec,
                      cache_salt: str | None) -> AsyncIterator[ChoiceDelta]:
        output = ChoiceText(self.tokenizer, spec.prompt_ids, spec.params, spec.stops,
                            self.eos_token_ids, spec.include_stop_str_in_output,
                            spec.skip_special_tokens)
        deltas = self.pipeline.generate(f"{request_id}-{spec.index}", spec.prompt_ids,
                                        spec.params, cache_salt)
        self.metrics.prompt_tokens.inc(len(spec.prompt_ids))
        start = time.perf_counter()
        first_token_at: float | None = None
        num_tokens = 0
        try:
            async for delta in deltas:
                # a migrated request's later attempts report their resumed prompts: only the
                # first report is the request's
                cached = delta.num_cached_tokens if first_token_at is None else None
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                    self.metrics.first_token(first_token_at - start)
                num_tokens += len(delta.token_ids)
                if delta.finish_reason is FinishReason.ERROR:
                    raise GenerationError(delta.error or "generation failed")
                scores = list(delta.prompt_logprobs) if delta.prompt_logprobs is not None \
                    else None
                if spec.prompt_only:  # the one token it ran is not part of the answer
                    yield ChoiceDelta(spec.index, "", [], [], "length", cached, scores)
                    self.metrics.observe_request(first_token_at - start,
                                                 time.perf_counter() - start, 0)
                    return
                final = delta.finish_reason is not None
                text = output.add(delta.token_ids, final)
                reason = "stop" if output.stop_string is not None \
                    else _finish_text(delta.finish_reason)
                yield ChoiceDelta(spec.index, text, list(delta.token_ids),
                                  list(delta.logprobs or ()), reason, cached, scores,
                                  output.stop_reason if reason == "stop" else None)
                if reason is not None:
                    self.metrics.observe_request(first_token_at - start,
                                                 time.perf_counter() - start, num_tokens)
                    return
        finally:
            await deltas.aclose()


def _finish_text(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"
