"""Stand-ins for the Ray handle calls the request path makes, for tests that replay a worker's
answers without Ray: an awaitable object ref, a streaming generator's refs, an actor method."""

from __future__ import annotations

import asyncio


class Ref:
    """An ObjectRef awaited for `value` (after one turn of the event loop, as a real one)."""

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return self.value


class Stream:
    """A streaming generator's ObjectRefGenerator over `values`."""

    def __init__(self, values) -> None:
        self._refs = iter([Ref(v) for v in values])

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self._refs)
        except StopIteration:
            raise StopAsyncIteration from None


class Method:
    """An actor method: `.options(...).remote(*args)` records args and returns `result`."""

    def __init__(self, result) -> None:
        self.result, self.calls = result, []

    def options(self, **_):
        return self

    def remote(self, *args):
        self.calls.append(args)
        return self.result
