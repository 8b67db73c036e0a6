"""The token path from a decode worker to the gateway, without Ray: the worker side
(decode_worker.outputs.SubscriberOutputs) with an emitting thread in place of the engine loop,
and the gateway side (router.decode_outputs.DecodeOutputs) over a stub actor handle whose
stream can fail. The real actors run it in every served test (tests/integration)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdcluster.decode_worker.outputs import SubscriberOutputs
from pdcluster.engine.protocol import FinishReason, TokenDelta
from pdcluster.router.decode_outputs import DecodeOutputs
from pdcluster.router.registry import Instance
from tests.router.ray_stubs import Ref


def test_a_burst_of_deltas_is_one_item_in_order_per_subscriber():
    async def main():
        aborted: list[str] = []
        outputs = SubscriberOutputs(asyncio.get_running_loop(), aborted.append)
        emits = {(sub, rid): outputs.add(sub, rid)
                 for sub in ("a", "b") for rid in (f"{sub}1", f"{sub}2")}

        def step(token: int, finish: FinishReason | None = None) -> None:
            for (sub, rid), emit in emits.items():  # one engine step's emits, on its thread
                emit(TokenDelta(rid, (token,), finish))

        streams = {sub: outputs.stream(sub) for sub in ("a", "b")}
        thread = threading.Thread(target=step, args=(7,))
        thread.start()
        thread.join()
        first = {sub: await anext(s) for sub, s in streams.items()}
        assert [(d.request_id, d.token_ids) for d in first["a"]] == [("a1", (7,)), ("a2", (7,))]
        assert [d.request_id for d in first["b"]] == ["b1", "b2"]
        # three steps before the consumer reads: one item, in emission order
        for token in (8, 9):
            step(token)
        step(10, FinishReason.LENGTH)
        await asyncio.sleep(0)
        batch = await anext(streams["a"])
        assert [(d.request_id, d.token_ids[0]) for d in batch] == [
            (rid, t) for t in (8, 9, 10) for rid in ("a1", "a2")]
        assert aborted == []
        await streams["a"].aclose()
        assert aborted == []  # its requests had finished
        await streams["b"].aclose()
        assert aborted == []

    asyncio.run(main())


def test_closing_a_stream_aborts_only_its_unfinished_requests():
    async def main():
        aborted: list[str] = []
        outputs = SubscriberOutputs(asyncio.get_running_loop(), aborted.append)
        done, running = outputs.add("gw", "done"), outputs.add("gw", "running")
        other = outputs.add("other", "elsewhere")
        stream = outputs.stream("gw")
        done(TokenDelta("done", (1,), FinishReason.STOP))
        running(TokenDelta("running", (2,)))
        other(TokenDelta("elsewhere", (3,)))
        assert [d.request_id for d in await anext(stream)] == ["done", "running"]
        await stream.aclose()
        assert aborted == ["running"]
        running(TokenDelta("running", (), FinishReason.ABORT))  # nobody reads it: dropped
        await asyncio.sleep(0)
        assert aborted == ["running"]

    asyncio.run(main())


class _FailingStream:
    """A decode actor's output stream: the batches put into `items`; an exception put there
    is raised, as a dead worker's stream raises."""

    def __init__(self) -> None:
        self.items: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.items.get()
        if isinstance(item, BaseException):
            raise item
        return Ref(item)


class _Handle:
    def __init__(self) -> None:
        self.streams: list[_FailingStream] = []
        self.subscribers: list[str] = []
        self.outputs = self

    def options(self, **_):
        return self

    def remote(self, subscriber: str):
        self.subscribers.append(subscriber)
        self.streams.append(_FailingStream())
        return self.streams[-1]


def test_a_failed_stream_reaches_every_request_on_it_and_the_next_request_reopens():
    async def main():
        handle = _Handle()
        instance = Instance("decode-0", "decode", handle)
        outputs = DecodeOutputs()
        queues = [outputs.register(instance, rid)[1] for rid in ("r1", "r2")]
        assert len(handle.streams) == 1  # one stream for both
        handle.streams[0].items.put_nowait([TokenDelta("r2", (5,)), TokenDelta("gone", (6,)),
                                            TokenDelta("r1", (4,))])
        assert (await queues[0].get()).token_ids == (4,)
        assert (await queues[1].get()).token_ids == (5,)
        outputs.release(instance, "r2")
        handle.streams[0].items.put_nowait(ConnectionResetError("worker died"))
        assert isinstance(await queues[0].get(), ConnectionResetError)
        assert queues[1].empty()  # released before: nothing more for it
        subscriber, again = outputs.register(instance, "r3")
        assert len(handle.streams) == 2 and handle.subscribers[1] == subscriber
        assert handle.subscribers[0] != subscriber  # the old one may still be open there
        handle.streams[1].items.put_nowait([TokenDelta("r3", (9,), FinishReason.STOP)])
        assert (await again.get()).finish_reason is FinishReason.STOP

    asyncio.run(main())


@pytest.mark.parametrize("n", [1, 3])
def test_each_event_loop_gets_its_own_stream(n):
    handle = _Handle()
    instance = Instance("decode-0", "decode", handle)
    outputs = DecodeOutputs()

    async def one(rid: str):
        _, queue = outputs.register(instance, rid)
        handle.streams[-1].items.put_nowait([TokenDelta(rid, (1,), FinishReason.STOP)])
        return (await queue.get()).request_id

    assert [asyncio.run(one(f"r{i}")) for i in range(n)] == [f"r{i}" for i in range(n)]
    assert len(handle.streams) == n and len(set(handle.subscribers)) == n
