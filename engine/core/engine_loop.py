"""The engine loop every worker runs: one thread builds the engine (its model included), then
repeats drain inbox → step (schedule → execute_model → update_from_output) until shut down.

Why one thread for both: with torch's OpenMP runtime (CPU), ops run ~1.8x slower on a thread
that is not the first of the process to use OpenMP (benchmarks/prefill_thread.py measures it;
numbers in docs/notes/cpu-runtime-findings.md, "The OpenMP first-thread penalty"). Building
the ModelRunner on the loop thread makes the loop that first thread, provided nothing in the
process ran torch ops before. One thread also means one owner: the scheduler, the KV cache
manager and the block pool are touched only here, so they need no locks; other threads talk to
the engine only through its inbox.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Generic, Protocol, TypeVar

from pdcluster.engine.core.messages import EngineMessage

log = logging.getLogger(__name__)


class EngineInbox:
    """The thread-safe way into an engine loop: messages (engine.core.messages) the loop hands
    to its engine's ``handle`` before each step, in the order they were posted."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[EngineMessage] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self.stopped = threading.Event()

    def post(self, message: EngineMessage) -> None:
        self._queue.put(message)
        self._wakeup.set()

    def drain(self) -> Iterator[EngineMessage]:
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def wait(self, timeout_s: float) -> None:
        """Sleep until a message is posted, the loop is stopped or ``timeout_s`` passed."""
        self._wakeup.wait(timeout=timeout_s)
        self._wakeup.clear()

    def stop(self) -> None:
        self.stopped.set()
        self._wakeup.set()


class LoopedEngine(Protocol):
    """What a worker's engine gives the loop; every method runs on the loop thread."""

    inbox: EngineInbox

    def handle(self, message: EngineMessage) -> None:
        """One inbox message."""

    def step(self) -> bool:
        """Schedule, execute, sample and postprocess once. False: there was nothing to run."""

    def idle_wait_s(self) -> float:
        """How long to sleep after a step with nothing to run (shorter while a transfer is
        polled), unless a message comes first."""

    def fail_step(self, exc: Exception) -> None:
        """A step raised ``exc``: end the requests it ran, so the loop can go on."""

    def close(self) -> None:
        """The loop ended: let go of what the engine holds (transfers, channels)."""


_C = TypeVar("_C", bound=LoopedEngine)


class EngineLoop(Generic[_C]):
    """Starts a daemon thread that builds ``build()`` and then runs it until :meth:`shutdown`.

    Args:
        build: makes the engine on the loop thread; what it raises is raised here.
        name: the thread's name.
        timeout_s: how long to wait for ``build``; None: no limit.
        freeze_heap: after ``build``, collect once and freeze every object the process then
            holds (``gc.freeze``), as vLLM's engine core does after start-up: the model, the
            engine and the libraries' objects stay for the process's life, and the collector's
            full passes over them took time from every step. For a process that is the loop's
            own (a worker actor); objects frozen are never collected.

    Attributes:
        core: what ``build`` returned.
        thread: the loop thread.
    """

    def __init__(self, build: Callable[[], _C], name: str, timeout_s: float | None = None,
                 freeze_heap: bool = False) -> None:
        built: Future = Future()
        self._freeze_heap = freeze_heap
        self.thread = threading.Thread(target=self._main, args=(build, built), name=name,
                                       daemon=True)
        self.thread.start()
        self.core: _C = built.result(timeout=timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop after the current step and wait (up to ``timeout_s``) for the engine to close.
        Idempotent."""
        self.core.inbox.stop()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=timeout_s)

    def _main(self, build: Callable[[], _C], built: Future) -> None:
        try:
            core = build()
        except BaseException as exc:  # noqa: BLE001 — re-raised in the constructor
            built.set_exception(exc)
            return
        if self._freeze_heap:
            gc.collect()
            gc.freeze()
        built.set_result(core)
        try:
            run_until_stopped(core)
        finally:
            core.close()


def run_once(core: LoopedEngine) -> bool:
    """One loop iteration without sleeping: the inbox's messages, then one step. Returns what
    the step returned; a step that raised counts as having run."""
    try:
        for message in core.inbox.drain():
            core.handle(message)
        return core.step()
    except Exception as exc:  # noqa: BLE001 — the loop must outlive one bad step
        log.exception("engine step failed; failing the requests it ran")
        core.fail_step(exc)
        return True


def run_until_stopped(core: LoopedEngine) -> None:
    """The loop body, on the calling thread, until ``core.inbox.stop()``."""
    while not core.inbox.stopped.is_set():
        if not run_once(core):
            core.inbox.wait(core.idle_wait_s())
