"""router.inflight: the gateway's in-flight bound and its drain (no Ray needed)."""

from __future__ import annotations

import asyncio

import pytest

from router.inflight import InflightGate, Overloaded


def test_limit_counts_sequences_and_refuses_past_it():
    gate = InflightGate(4, retry_after_s=2)
    assert gate.acquire(3) == 3
    with pytest.raises(Overloaded) as info:
        gate.acquire(2)
    assert info.value.reason == "overloaded" and info.value.retry_after_s == 2
    assert gate.acquire(1) == 1 and gate.inflight == 4
    gate.release(3)
    assert gate.acquire(3) == 3


def test_a_request_larger_than_the_limit_runs_alone():
    gate = InflightGate(4)
    assert gate.acquire(16) == 4  # capped: it takes the whole gate
    with pytest.raises(Overloaded):
        gate.acquire(1)
    gate.release(4)
    assert gate.inflight == 0


def test_draining_refuses_everything_and_wait_idle_sees_the_last_release():
    async def main() -> tuple[bool, bool]:
        gate = InflightGate(None)
        taken = gate.acquire(5)
        gate.start_draining()
        with pytest.raises(Overloaded) as info:
            gate.acquire(1)
        assert info.value.reason == "draining"
        timed_out = await gate.wait_idle(0.05)
        asyncio.get_running_loop().call_later(0.05, gate.release, taken)
        return timed_out, await gate.wait_idle(5)

    assert asyncio.run(main()) == (False, True)


def test_limit_must_be_positive():
    with pytest.raises(ValueError):
        InflightGate(0)
