"""engine.core.engine_loop.EngineLoop's heap freeze: a worker actor's loop moves what the
process holds after building its engine out of the collector's passes (gc.freeze)."""

from __future__ import annotations

import gc

import pytest

from pdcluster.engine.core.engine_loop import EngineInbox, EngineLoop


class _IdleCore:
    """An engine with nothing to run."""

    def __init__(self) -> None:
        self.inbox = EngineInbox()

    def handle(self, kind, item) -> None:
        pass

    def step(self) -> bool:
        return False

    def idle_wait_s(self) -> float:
        return 0.01

    def fail_step(self, exc: Exception) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process's objects go back to the collector


@pytest.mark.parametrize("freeze_heap", [False, True])
def test_the_loop_freezes_the_heap_after_building_only_when_asked(unfrozen, freeze_heap):
    loop = EngineLoop(_IdleCore, "test-loop", timeout_s=10, freeze_heap=freeze_heap)
    try:
        # the engine built, and everything alive then, is frozen: more than the engine alone
        assert (gc.get_freeze_count() > 100) == freeze_heap
    finally:
        loop.shutdown()
    assert not loop.thread.is_alive()
