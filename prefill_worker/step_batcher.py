"""Packs the chunks of concurrent prefills into shared forward steps (vLLM's chunked prefill
scheduler: one step batches chunks of several requests under one token budget).

Each prefill thread hands its chunks over one at a time (a request's chunk t+1 attends to
the KV chunk t wrote, so one request never has two chunks in a step) and blocks until its
chunk ran. Whichever waiting thread finds no step running becomes the step's leader: it takes
pending chunks first come, first served while they fit `budget_tokens` (the first always
goes, whatever its size), runs them as one `ModelRunner.execute`, hands each its logits row and
wakes the others. No thread of its own, no added latency: a lone request runs its chunks back
to back, and requests that arrive while a step runs share the next one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.runner import ModelRunner, SequenceChunk


@dataclass
class _Pending:
    chunk: SequenceChunk
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


class StepBatcher:
    """Runs chunks of concurrent callers in shared steps of at most `budget_tokens` new tokens.

    model_lock: held around each forward, shared with code that must run the model alone
    (--kv-streaming layer's hooked forwards). call: runs the forward, ``call(fn, *args)``
    (engine.model_thread.ModelThread.call: on the thread that built the model); default in
    place. Counters: num_steps_total, num_chunks_total, max_chunks_per_step. Thread-safe.
    """

    def __init__(self, runner: ModelRunner, budget_tokens: int, model_lock: threading.RLock,
                 call: Callable[..., torch.Tensor] | None = None) -> None:
        self.runner = runner
        self.call = call or (lambda fn, *args: fn(*args))
        self.budget_tokens = budget_tokens
        self.model_lock = model_lock
        self._cv = threading.Condition()
        self._queue: list[_Pending] = []
        self._running = False
        self.num_in_step = 0  # chunks of the step now running
        self.num_steps_total = 0
        self.num_chunks_total = 0
        self.max_chunks_per_step = 0

    def run(self, chunk: SequenceChunk) -> torch.Tensor:
        """Logits [1, vocab] (float32) of the chunk's last token, once its step ran.

        Raises what the step's `ModelRunner.execute` raised (every chunk of that step fails)."""
        mine = _Pending(chunk)
        with self._cv:
            self._queue.append(mine)
        while True:
            with self._cv:
                while self._running and not mine.done:
                    self._cv.wait()
                if mine.done:
                    break
                self._running = True
                step = self._take()
                self.num_in_step = len(step)
            self._run_step(step)
        if mine.error is not None:
            raise mine.error
        return mine.logits

    def _take(self) -> list[_Pending]:
        step, tokens = [], 0
        while self._queue:
            size = len(self._queue[0].chunk.token_ids)
            if step and tokens + size > self.budget_tokens:
                break
            step.append(self._queue.pop(0))
            tokens += size
        return step

    def _run_step(self, step: list[_Pending]) -> None:
        try:
            with self.model_lock:
                logits = self.call(self.runner.execute, [p.chunk for p in step])
            for row, pending in enumerate(step):
                pending.logits = logits[row:row + 1]
        except BaseException as exc:  # noqa: BLE001 — handed to every caller of the step
            for pending in step:
                pending.error = exc
        finally:
            with self._cv:
                for pending in step:
                    pending.done = True
                self._running = False
                self.num_in_step = 0
                self.num_steps_total += 1
                self.num_chunks_total += len(step)
                self.max_chunks_per_step = max(self.max_chunks_per_step, len(step))
                self._cv.notify_all()

    @property
    def num_pending(self) -> int:
        """Chunks handed over and not yet run (queued, or in the running step)."""
        with self._cv:
            return len(self._queue) + self.num_in_step

    def stats(self) -> dict:
        return {"num_prefill_steps_total": self.num_steps_total,
                "num_prefill_chunks_total": self.num_chunks_total,
                "max_prefill_chunks_per_step": self.max_chunks_per_step}
