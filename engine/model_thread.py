"""A thread that builds the model and then runs every forward handed to it.

Why: with torch's OpenMP runtime (CPU), ops run ~1.8x slower on a thread that is not the first
of the process to use OpenMP (measured: a 100M-model decode step at batch 21, 0.165 s vs
0.09 s; benchmarks/RESULTS.md, "Throughput"). A worker whose forwards would otherwise run on
whichever RPC thread called it (Ray's actor call threads) builds its ModelRunner here and
hands each forward over with :meth:`ModelThread.call`; a hand-over costs tens of
microseconds against forwards of milliseconds. The decode engine needs none of this: its own
loop thread builds the model (decode_worker.actor.run_engine_thread).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")


class ModelThread(Generic[_T]):
    """Builds ``build()`` on a new daemon thread, then runs callables there in order.

    Args:
        build: makes the object (e.g. a ModelRunner) on the thread; what it raises is raised
            here.
        name: the thread's name.
        timeout_s: how long to wait for ``build``; None: no limit.

    Attributes:
        built: what ``build`` returned.
    """

    def __init__(self, build: Callable[[], _T], name: str, timeout_s: float | None = None):
        self._tasks: queue.SimpleQueue[tuple[Callable, tuple, Future] | None] = \
            queue.SimpleQueue()
        ready: Future = Future()
        self._thread = threading.Thread(target=self._main, args=(build, ready), name=name,
                                        daemon=True)
        self._thread.start()
        self.built: _T = ready.result(timeout=timeout_s)

    def call(self, fn: Callable[..., _R], *args) -> _R:
        """``fn(*args)`` on the model thread; blocks until done and returns or raises what it
        did. Called on the model thread itself, runs it in place."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        done: Future = Future()
        self._tasks.put((fn, args, done))
        return done.result()

    def close(self) -> None:
        """Let the thread end after the calls already handed over. Idempotent."""
        self._tasks.put(None)

    def _main(self, build: Callable[[], _T], ready: Future) -> None:
        try:
            ready.set_result(build())
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the constructor
            ready.set_exception(exc)
            return
        while (task := self._tasks.get()) is not None:
            fn, args, done = task
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 -- re-raised in the caller
                done.set_exception(exc)
