"""What other threads tell an engine through its inbox (vLLM's EngineCoreRequestType: add,
abort, utility calls), one type per message, handled on the engine loop in the order posted."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.engine.core.request import Request


@dataclass(frozen=True)
class AddRequest:
    request: Request


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class CallSoon:
    """Run ``fn`` on the loop before the next step."""

    fn: Callable[[], object]


@dataclass(frozen=True)
class ResetPrefixCache:
    """Drop every cached key; ``done`` gets whether it was done (vLLM's
    ``reset_prefix_cache``)."""

    done: Future


@dataclass(frozen=True)
class Wake:
    """Something settled off the loop (a KV load, a grammar compile): the next step polls it."""


EngineMessage = AddRequest | AbortRequest | CallSoon | ResetPrefixCache | Wake
