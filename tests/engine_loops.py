"""Engines for in-process tests, run as the worker actors run them: built on, and driven by,
an engine loop thread (engine.core.engine_loop.EngineLoop)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pdcluster.engine.core.engine_loop import EngineLoop

_E = TypeVar("_E")
_loops: dict[int, EngineLoop] = {}


def started(build: Callable[[], _E], name: str = "test-engine") -> _E:
    """``build()`` on a new engine loop thread, which then runs it; the engine."""
    loop = EngineLoop(build, name, timeout_s=120)
    _loops[id(loop.core)] = loop
    return loop.core


def stop(engine) -> None:
    """Stop the loop that runs ``engine`` and wait for it to close."""
    _loops.pop(id(engine)).shutdown()
