"""Long-lived FetchBlocks sessions of one KV store client, and the deadlines that bound them.

A new gRPC call costs a stream setup, its metadata and a hand-over to a server thread on every
transfer (about 0.6 ms in Python on a loopback, 0.26 ms for one more message on an open stream;
benchmarks/RESULTS.md). A :class:`FetchSession` keeps one bidirectional ``FetchBlocks`` stream
open and carries one request at a time; :class:`SessionPool` hands idle sessions out, keeps at
most ``max_idle`` of them and closes those idle longer than ``idle_s``: each open session
holds a server handler thread (kvstore.server.KVStoreServer ``max_workers``).

A session's RPC has no gRPC deadline (it outlives any one transfer); each request's deadline
is a :class:`Deadlines` entry that cancels the session when it passes. A session that was
cancelled, failed, or left with part of a reply unread is closed, never reused.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import grpc

from pdcluster.kvstore.errors import BlockLayoutError, KVTransferError, KVTransferTimeout
from pdcluster.kvstore.layout import BlockLayout
from pdcluster.kvstore.proto import kvstore_pb2 as pb
from pdcluster.kvstore.rpc_errors import fetch_error, rpc_error
from pdcluster.kvstore.transport.wire import decode_block_data


class FetchSession:
    """One open FetchBlocks stream: ``send`` a request, ``read`` its reply's messages.

    Args:
        method: the channel's ``stream_stream`` callable for FetchBlocks (replies undecoded).
        metadata: call metadata (the token).
    """

    def __init__(self, method, metadata):
        self._requests: queue.SimpleQueue[pb.GetBlocksRequest | None] = queue.SimpleQueue()
        self._call = method(iter(self._requests.get, None), metadata=metadata)
        self.broken = False
        self.idle_since = time.monotonic()

    def send(self, request: pb.GetBlocksRequest) -> None:
        """Queue ``request`` on the stream (gRPC's request thread writes it)."""
        self._requests.put(request)

    def read(self) -> bytes:
        """The next reply message. Raises grpc.RpcError, or StopIteration if the stream ended."""
        return next(self._call)

    def cancel(self) -> None:
        """Cancel the RPC (any thread; a blocked ``read`` raises). Idempotent."""
        self.broken = True
        self._requests.put(None)
        self._call.cancel()


class Deadlines:
    """One daemon thread that runs callbacks when their deadline passes, and every
    ``sweep_s`` seconds runs ``sweep`` (closing idle sessions).

    ``add`` is cheap (a heap push; the thread is woken only for an earlier deadline than any
    it waits for); ``discard`` marks an entry done without searching the heap.
    """

    def __init__(self, sweep: Callable[[], None], sweep_s: float, name: str):
        self._sweep, self._sweep_s = sweep, sweep_s
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def add(self, when: float, fn: Callable[[], None]) -> int:
        """Run ``fn`` at ``time.monotonic() >= when`` unless discarded first; returns a handle."""
        with self._cond:
            handle = next(self._ids)
            earliest = self._heap[0][0] if self._heap else None
            heapq.heappush(self._heap, (when, handle, fn))
            self._live.add(handle)
            if earliest is None or when < earliest:
                self._cond.notify()
            return handle

    def discard(self, handle: int) -> None:
        with self._cond:
            self._live.discard(handle)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _loop(self) -> None:
        next_sweep = time.monotonic() + self._sweep_s
        while True:
            due: list[Callable[[], None]] = []
            with self._cond:
                while not self._closed:
                    now = time.monotonic()
                    while self._heap and (self._heap[0][1] not in self._live
                                          or self._heap[0][0] <= now):
                        _, handle, fn = heapq.heappop(self._heap)
                        if handle in self._live:
                            self._live.discard(handle)
                            due.append(fn)
                    if due or now >= next_sweep:
                        break
                    until = min(next_sweep, self._heap[0][0]) if self._heap else next_sweep
                    self._cond.wait(until - now)
                if self._closed:
                    return
            for fn in due:
                fn()
            if time.monotonic() >= next_sweep:
                self._sweep()
                next_sweep = time.monotonic() + self._sweep_s


class SessionPool:
    """Idle FetchSessions of one channel, most recently used first.

    Args:
        open_session: makes a new FetchSession.
        max_idle: idle sessions kept; more are closed when released.
        idle_s: an idle session is closed after this long (the Deadlines thread sweeps every
            ``idle_s / 2``).
    """

    def __init__(self, open_session: Callable[[], FetchSession], max_idle: int = 4,
                 idle_s: float = 10.0):
        self._open = open_session
        self._max_idle, self._idle_s = max_idle, idle_s
        self._idle: list[FetchSession] = []
        self._lock = threading.Lock()
        self._closed = False
        self.opened = 0  # sessions opened so far
        self.deadlines = Deadlines(self.sweep, max(0.05, idle_s / 2), "kv-fetch-sessions")

    def acquire(self) -> FetchSession:
        """An idle session, or a new one."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.opened += 1
        return self._open()

    def release(self, session: FetchSession) -> None:
        """Return a session whose last reply was read to its end (a broken one is closed)."""
        with self._lock:
            if not (session.broken or self._closed or len(self._idle) >= self._max_idle):
                session.idle_since = time.monotonic()
                self._idle.append(session)
                return
        session.cancel()

    def sweep(self) -> None:
        """Close sessions idle longer than ``idle_s``."""
        cutoff = time.monotonic() - self._idle_s
        with self._lock:
            stale = [s for s in self._idle if s.idle_since < cutoff]
            self._idle = [s for s in self._idle if s.idle_since >= cutoff]
        for session in stale:
            session.cancel()

    def close(self) -> None:
        """Close every idle session, and later releases. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for session in idle:
            session.cancel()
        self.deadlines.close()


class BlockChunk(NamedTuple):
    """One message of a block stream: blocks ``[start, start + count)`` of the request.

    ``payload`` (``count * layout.nbytes`` little-endian bytes) is a read-only view into the
    received message, valid as long as the chunk is referenced.
    """

    start: int
    count: int
    layout: BlockLayout
    payload: memoryview


class BlockStream:
    """One fetch from the store at ``address`` on a session of ``sessions``: iterate for
    :class:`BlockChunk` s, ``cancel()`` to stop.

    Iterating sends the request and reads its reply to the ``last`` message; the session goes
    back to the pool only then (or after an in-band error, which ends the reply). Iteration
    raises the typed errors of kvstore.rpc_errors, as KVStoreClient.get_blocks does; past
    ``timeout_s`` or after ``cancel()`` it raises KVTransferError. ``cancel`` is thread-safe and
    only ever touches the session while this stream holds it.
    """

    def __init__(self, address: str, sessions: SessionPool, keys: Sequence[bytes],
                 request: pb.GetBlocksRequest, timeout_s: float):
        self._address, self._pool, self._keys = address, sessions, keys
        self._request, self._timeout_s = request, timeout_s
        self._lock = threading.Lock()
        self._session: FetchSession | None = None
        self._cancelled = self._expired = False

    def cancel(self) -> None:
        """Stop the fetch (its session is closed, not reused). Idempotent."""
        with self._lock:
            self._cancelled = True
            session = self._session
        if session is not None:
            session.cancel()

    def _expire(self) -> None:
        self._expired = True
        self.cancel()

    def __iter__(self) -> Iterator[BlockChunk]:
        address, keys = self._address, self._keys
        where = f"{address}: FetchBlocks"
        session = self._pool.acquire()
        with self._lock:
            if self._cancelled:
                session.cancel()
                raise KVTransferError(f"{where} cancelled", address=address)
            self._session = session
        deadline = self._pool.deadlines.add(time.monotonic() + self._timeout_s, self._expire)
        complete = False
        try:
            session.send(self._request)
            received = 0
            layout: BlockLayout | None = None
            while True:
                msg = decode_block_data(session.read())
                if msg.error is not None:
                    complete = msg.last  # the reply ended; the session serves the next one
                    raise fetch_error(address, msg.error)
                n = len(msg.keys)
                if n:
                    msg_layout = BlockLayout(msg.layout.dtype, tuple(msg.layout.shape))
                    layout = layout or msg_layout
                    if msg_layout != layout:
                        raise BlockLayoutError(f"blocks from {address} mix layouts "
                                               f"{layout} and {msg_layout}")
                    if list(msg.keys) != list(keys[received:received + n]) or \
                            len(msg.payload) != n * layout.nbytes:
                        raise BlockLayoutError(f"malformed FetchBlocks reply from "
                                               f"{address} at block {received}")
                    yield BlockChunk(received, n, layout, msg.payload)
                    received += n
                if msg.last:
                    break
            if received != len(keys):
                raise KVTransferError(f"{where} reply ended after {received} of {len(keys)} "
                                      f"block(s)", address=address)
            complete = True
        except grpc.RpcError as exc:
            if self._expired:
                raise KVTransferTimeout(f"{where} exceeded its deadline of {self._timeout_s:g} s",
                                        address=address) from None
            if self._cancelled:
                raise KVTransferError(f"{where} cancelled", address=address) from None
            raise rpc_error(address, "FetchBlocks", exc) from None
        except (StopIteration, ValueError) as exc:  # stream ended / channel closed
            raise KVTransferError(f"{where} failed: stream closed {exc}".rstrip(),
                                  address=address) from None
        finally:
            self._pool.deadlines.discard(deadline)
            with self._lock:
                self._session = None
            if complete:
                self._pool.release(session)
            else:
                session.cancel()
