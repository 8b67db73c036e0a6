"""router.inflight: the gateway's fair queue of sequences and its drain (no Ray needed)."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.router.inflight import InflightGate, Overloaded


def run(coro):
    return asyncio.run(coro)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_limit_counts_sequences_and_the_queue_bounds_what_waits():
    async def main() -> None:
        gate = InflightGate(4, max_queued=2, reserve=0, retry_after_s=2)
        a = gate.open(3)
        for _ in range(3):
            await a.acquire()
        b = gate.open(3)  # 1 runs, 2 wait: limit + queue = 6 sequences in all
        await b.acquire()
        assert (gate.inflight, gate.queued) == (4, 2)
        with pytest.raises(Overloaded) as info:
            gate.open(1)
        assert info.value.reason == "overloaded" and info.value.retry_after_s == 2
        waiting = [asyncio.create_task(b.acquire()) for _ in range(2)]
        await settle()
        assert not any(t.done() for t in waiting)
        a.release()
        await settle()
        assert sum(t.done() for t in waiting) == 1 and gate.inflight == 4
        a.close()  # returns its 2 remaining slots
        await asyncio.gather(*waiting)
        assert (gate.inflight, gate.queued) == (3, 0)
        b.close()
        assert (gate.inflight, gate.queued) == (0, 0)

    run(main())


def test_slots_go_round_robin_across_requests():
    """A request of many sequences that fills the gate cannot make later small requests wait
    for all of its queued sequences: each freed slot goes to the next request in turn."""

    async def main() -> list[str]:
        gate = InflightGate(2, max_queued=100, reserve=0)
        order: list[str] = []
        big = gate.open(10)
        for _ in range(2):
            await big.acquire()

        async def sequence(ticket, name: str) -> None:
            await ticket.acquire()
            order.append(name)

        tasks = [asyncio.create_task(sequence(big, "big")) for _ in range(8)]
        await settle()
        small = [gate.open(1) for _ in range(3)]
        tasks += [asyncio.create_task(sequence(t, f"small{i}")) for i, t in enumerate(small)]
        await settle()
        for _ in range(11):  # each release frees one slot; whoever got it releases it later
            big.release() if big.held else next(t for t in small if t.held).release()
            await settle()
        await asyncio.gather(*tasks)
        return order

    order = run(main())
    # big's 8 waiters queued first, yet one turn of the rotation serves each request once:
    # the smalls come right after big's next sequence instead of after all 8
    assert order[:4] == ["big", "small0", "small1", "small2"], order
    assert order.count("big") == 8


def test_a_lower_priority_value_is_served_first_round_robin_within_one():
    """vLLM's priority scheduling at the gate: queued sequences of priority -1 get slots
    before those of priority 0 queued earlier, which keep their round-robin among
    themselves."""

    async def main() -> list[str]:
        gate = InflightGate(1, max_queued=100, reserve=0)
        holder = gate.open(1)
        await holder.acquire()
        order: list[str] = []

        async def sequence(ticket, name: str) -> None:
            await ticket.acquire()
            order.append(name)
            await settle()
            ticket.release()

        tickets = {name: gate.open(2, priority) for name, priority in
                   (("a", 0), ("b", 0), ("urgent", -1))}
        tasks = [asyncio.create_task(sequence(t, name)) for name, t in tickets.items()
                 for _ in range(2)]
        await settle()
        holder.release()
        await asyncio.gather(*tasks)
        return order

    assert run(main()) == ["urgent", "urgent", "a", "b", "a", "b"]


def test_a_full_queue_refuses_queued_less_urgent_requests_for_a_more_urgent_one():
    """SGLang's rule for a full queue under priority scheduling: the newcomer pushes out
    queued requests of a higher priority value, least urgent then newest first; a request
    with a started sequence, or one as urgent, is never pushed out, and when those that may go
    hold too little room the newcomer is refused and nobody else is."""

    async def main() -> None:
        gate = InflightGate(1, max_queued=5, reserve=0)
        order: list[str] = []

        async def take(ticket, name: str) -> None:
            await ticket.acquire()
            order.append(name)
            await settle()
            ticket.release()

        running = gate.open(2, priority=9)  # started: its waiting sequence stays
        await running.acquire()
        low_old, low_new, mid = gate.open(1, 5), gate.open(2, 5), gate.open(1, 3)
        tasks = {name: asyncio.create_task(take(t, name)) for name, t in
                 (("low_old", low_old), ("low_new", low_new), ("low_new2", low_new),
                  ("mid", mid), ("running", running))}
        await settle()
        assert (gate.inflight, gate.queued) == (1, 5)

        with pytest.raises(Overloaded) as info:  # as urgent as the least urgent: none may go
            gate.open(1, 5)
        assert info.value.reason == "overloaded" and gate.queued == 5
        with pytest.raises(Overloaded):  # low_old and low_new hold 3 of the 5 wanted, and mid
            gate.open(5, 4)  # is more urgent: refused, nobody pushed out
        assert not any(t.done() for t in tasks.values())

        urgent = gate.open(2, 0)  # needs 2: low_new (newest of the least urgent) goes
        await settle()
        for name in ("low_new", "low_new2"):
            with pytest.raises(Overloaded) as info:
                await tasks.pop(name)
            assert info.value.reason == "preempted"
        with pytest.raises(Overloaded):  # a later sequence of it is refused too
            await low_new.acquire()
        low_new.close()
        assert not any(t.done() for t in tasks.values())
        assert (gate.inflight, gate.queued) == (1, 5)

        tasks.update({f"urgent{i}": asyncio.create_task(take(urgent, "urgent"))
                      for i in range(2)})
        await settle()
        running.release()
        await asyncio.gather(*tasks.values())
        assert order == ["urgent", "urgent", "mid", "low_old", "running"]
        for ticket in (running, low_old, mid, urgent):
            ticket.close()
        assert (gate.inflight, gate.queued) == (0, 0)

    run(main())


def test_the_reserve_admits_a_new_request_while_big_ones_wait():
    async def main() -> None:
        gate = InflightGate(8, max_queued=100, reserve=2)
        big = gate.open(10)
        for _ in range(6):  # 6 of 8: the last 2 are the reserve
            await big.acquire()
        blocked = asyncio.create_task(big.acquire())
        await settle()
        assert not blocked.done() and gate.inflight == 6
        small = gate.open(2)
        await small.acquire()  # its first sequence takes a reserved slot at once
        second = asyncio.create_task(small.acquire())
        await settle()
        assert not second.done()  # its second is not a first sequence: it waits its turn
        assert gate.inflight == 7
        small.close()
        big.close()
        await asyncio.gather(blocked, second, return_exceptions=True)
        assert (gate.inflight, gate.queued) == (0, 0)

    run(main())


def test_a_cancelled_waiter_takes_nothing_and_close_withdraws_the_rest():
    async def main() -> None:
        gate = InflightGate(1, max_queued=10, reserve=0)
        a = gate.open(1)
        await a.acquire()
        b = gate.open(3)
        waiter = asyncio.create_task(b.acquire())
        await settle()
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        a.close()
        assert gate.inflight == 0  # nobody got the slot: the cancelled waiter left the queue
        b.close()
        assert (gate.inflight, gate.queued) == (0, 0)
        assert await gate.wait_idle(0.1)

    run(main())


def test_draining_refuses_everything_and_wait_idle_sees_the_last_release():
    async def main() -> tuple[bool, bool]:
        gate = InflightGate(None)
        ticket = gate.open(5)
        for _ in range(5):
            await ticket.acquire()
        gate.start_draining()
        with pytest.raises(Overloaded) as info:
            gate.open(1)
        assert info.value.reason == "draining"
        timed_out = await gate.wait_idle(0.05)
        asyncio.get_running_loop().call_later(0.05, ticket.close)
        return timed_out, await gate.wait_idle(5)

    assert run(main()) == (False, True)


def test_bad_settings():
    with pytest.raises(ValueError):
        InflightGate(0)
    with pytest.raises(ValueError):
        InflightGate(4, reserve=4)
    with pytest.raises(ValueError):
        InflightGate(4, max_queued=-1)
