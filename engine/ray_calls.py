"""Waiting for a Ray call's result from a worker's own threads without ``ray.get``.

A decode worker is an async actor, and Ray warns of (and counts as blocking its event loop)
any ``ray.get`` in such a process, from whichever thread. Its engine loop and connector threads
wait on other actors (the node's KV store, the index, peers) through the object ref's future
instead, which blocks only the calling thread.
"""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout

import ray


def result(ref: ray.ObjectRef, timeout_s: float | None = None):
    """The call's value, as ``ray.get(ref, timeout=timeout_s)`` gives it. Raises what the call
    raised (RayTaskError, RayActorError, ...), or GetTimeoutError past ``timeout_s``."""
    try:
        return ref.future().result(timeout=timeout_s)
    except FutureTimeout:
        raise ray.exceptions.GetTimeoutError(
            f"call did not return within {timeout_s} s") from None


def results(refs: list[ray.ObjectRef], timeout_s: float | None = None) -> list:
    """Every call's value, in order, within one deadline of ``timeout_s`` in all."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    return [result(ref, None if deadline is None else max(0.0, deadline - time.monotonic()))
            for ref in refs]
