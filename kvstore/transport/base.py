"""The transfer abstraction: a poll state, a fetch request, transfer/receiver/backend bases.

Modelled on SGLang's ``disaggregation/base/conn.py`` (KVPoll, BaseKVReceiver, BaseKVSender),
with a deadline on every transfer and typed errors, so no transfer can hang its caller.

Invariants every backend keeps:

* ``start`` never blocks; work happens on the backend's threads (or at ``poll`` time).
* ``poll`` never blocks and enforces the deadline: past it, the transfer is aborted and FAILED
  with :class:`KVTransferError`.
* Once ``poll`` has returned FAILED (or ``abort`` has returned), nothing more is written to the
  destination, so the caller may free or reuse the blocks it pre-allocated at once. Writes go
  through :meth:`_TransferBase._write`; ``abort`` stops new ones and waits for those in
  progress.
* A terminal state (SUCCESS, FAILED) never changes.
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.errors import (BlockLayoutError, KVStoreError, KVTransferError,
                                      KVTransferTimeout)

if TYPE_CHECKING:
    from pdcluster.kvstore.transport.dest import CallbackDest

_T = TypeVar("_T")


class TransferState(enum.Enum):
    """Poll state of one transfer (SGLang's KVPoll)."""

    BOOTSTRAPPING = "bootstrapping"        # connecting: channel or pair group not ready yet
    WAITING_FOR_INPUT = "waiting_for_input"  # ready, nothing to move yet (not started / no data)
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (TransferState.SUCCESS, TransferState.FAILED)


@dataclass(frozen=True)
class FetchRequest:
    """What a decode worker fetches: a prompt's full blocks by key, then its tail block.

    Attributes:
        address: ``host:port`` of the source: the prefill node's KV store (grpc) or the
            sender's pair store (torch).
        keys: chained sha256 keys of the full blocks, in prompt order (request blocks
            ``0 .. len(keys)-1``).
        tail_handle: handle of the partial tail block (request block ``len(keys)``), or None.
        num_tail_tokens: valid tokens in the tail block (checked against the store's).
        deadline_s: seconds from ``start`` the whole transfer may take; ``None`` = the
            backend's ``KVTransferConfig.timeout_s``.
        tag: torch only: the transfer's tag, agreed with the sender over the control plane
            (unique among the pair's in-flight transfers, 0 <= tag < 2**31).
        region: mooncake only: where the source registered the blocks
            (kvstore.transport.mooncake.backend.RemoteRegion).
    """

    address: str
    keys: tuple[bytes, ...]
    tail_handle: str | None = None
    num_tail_tokens: int = 0
    deadline_s: float | None = None
    tag: int = 0
    region: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        if not 0 <= self.tag < 2**31:
            raise ValueError(f"tag must be in [0, 2**31), got {self.tag}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")

    @property
    def num_blocks(self) -> int:
        """Blocks the transfer fills: the full ones plus the tail, if any."""
        return len(self.keys) + (self.tail_handle is not None)


class _Cancelled(Exception):
    """Raised inside a backend thread by :meth:`_TransferBase._write` after an abort."""


class _TransferBase:
    """State machine shared by receivers and senders: thread-safe, terminal states sticky."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes_done = threading.Condition(threading.Lock())  # guards the two below
        self._writers = 0  # destination writes in progress (concurrent across streams)
        self._state = TransferState.WAITING_FOR_INPUT
        self._error: KVStoreError | None = None
        self._cancelled = False
        self._nbytes = 0
        self._deadline: float | None = None  # time.monotonic() value

    def poll(self) -> TransferState:
        """Current state; aborts and fails the transfer once its deadline has passed."""
        state = self._state
        if not state.done and self._deadline is not None and time.monotonic() > self._deadline:
            self._abort_with(KVTransferTimeout(f"{self._describe()} exceeded its deadline",
                                               address=self._address()))
            state = self._state
        return state

    def result(self) -> int:
        """Bytes moved, once SUCCESS.

        Raises:
            KVStoreError subclass: the error the transfer FAILED with.
            RuntimeError: the transfer has not finished (poll until ``state.done``).
        """
        state = self.poll()
        if state is TransferState.FAILED:
            assert self._error is not None
            raise self._error
        if state is not TransferState.SUCCESS:
            raise RuntimeError(f"{self._describe()} not finished ({state.name})")
        return self._nbytes

    def abort(self) -> None:
        """Stop the transfer; FAILED with KVTransferError unless already done. Idempotent.

        On return nothing more will be written to the destination.
        """
        self._abort_with(KVTransferError(f"{self._describe()} aborted", address=self._address()))

    # ---- for backends -----------------------------------------------------------------

    def _begin(self, deadline_s: float, state: TransferState) -> None:
        with self._lock:
            if self._deadline is not None:
                raise RuntimeError(f"{self._describe()} already started")
            self._deadline = time.monotonic() + deadline_s
            self._state = state

    def _extend_deadline(self, seconds: float) -> None:
        """Move the deadline to at least ``seconds`` from now (a stream that keeps making
        progress: its deadline bounds the silence between two pieces, not the whole stream)."""
        with self._lock:
            if not self._state.done and self._deadline is not None:
                self._deadline = max(self._deadline, time.monotonic() + seconds)

    def _remaining_s(self) -> float:
        """Seconds left before the deadline (>= 0)."""
        assert self._deadline is not None
        return max(0.0, self._deadline - time.monotonic())

    def _set_state(self, state: TransferState) -> None:
        with self._lock:
            if not self._state.done:
                self._state = state

    def _add_bytes(self, n: int) -> None:
        with self._lock:
            self._nbytes += n

    def _succeed(self) -> None:
        self._set_state(TransferState.SUCCESS)

    def _fail(self, error: KVStoreError) -> None:
        """Record a failure found by a backend thread, and release the backend's resources."""
        self._abort_with(error)

    def _guarded(self, fn: Callable[..., object], *args) -> bool:
        """Run one step of the transfer on a backend thread; True if it completed. An error
        FAILS the transfer: a KVStoreError as it is, anything else (a bug, an unexpected
        library error) as a KVTransferError; after an abort (_Cancelled) it just stops."""
        try:
            fn(*args)
            return True
        except _Cancelled:
            return False
        except KVStoreError as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001 — still a typed FAILED
            self._fail(KVTransferError(f"{self._describe()}: {exc!r}", address=self._address()))
        return False

    def _write(self, fn: Callable[..., _T], *args) -> _T:
        """Run a destination write unless the transfer was aborted (then raise _Cancelled).

        Writes of one transfer may run concurrently (one per stream); ``fn`` must not call
        :meth:`abort` (it would wait for itself)."""
        with self._writes_done:
            if self._cancelled:
                raise _Cancelled()
            self._writers += 1
        try:
            return fn(*args)
        finally:
            with self._writes_done:
                self._writers -= 1
                if self._writers == 0:
                    self._writes_done.notify_all()

    def _abort_with(self, error: KVStoreError) -> None:
        with self._writes_done:  # no write starts after this; wait for those in progress
            self._cancelled = True
            while self._writers:
                self._writes_done.wait()
        with self._lock:
            if self._state.done:
                return
            self._state, self._error = TransferState.FAILED, error
        self._release()

    def _release(self) -> None:
        """Backend hook, called once on failure: cancel calls, tear down channels."""

    def _describe(self) -> str:
        return type(self).__name__

    def _address(self) -> str | None:
        return None


class KVReceiver(_TransferBase, ABC):
    """The decode side of one transfer: fills pre-allocated destination blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.request: FetchRequest | None = None

    @abstractmethod
    def start(self, request: FetchRequest, dest: CallbackDest) -> None:
        """Begin fetching ``request.num_blocks`` blocks into ``dest``; returns at once.

        Raises:
            BlockLayoutError: ``dest`` has the wrong number of blocks.
            RuntimeError: already started.
        """

    def _accept(self, request: FetchRequest, dest: CallbackDest, deadline_s: float,
                state: TransferState = TransferState.TRANSFERRING) -> CallbackDest:
        """The common start: check ``dest`` against ``request`` (BlockLayoutError), record
        the request, start the deadline (``request.deadline_s`` wins over ``deadline_s``) in
        ``state``. Returns ``dest``."""
        if dest.num_blocks != request.num_blocks:
            raise BlockLayoutError(f"destination holds {dest.num_blocks} block(s), the request "
                                   f"{request.num_blocks}")
        self.request = request
        self._begin(request.deadline_s or deadline_s, state)
        return dest

    def _describe(self) -> str:
        if self.request is None:
            return type(self).__name__
        return f"{type(self).__name__} from {self.request.address}"

    def _address(self) -> str | None:
        return self.request.address if self.request is not None else None


class KVTransferBackend(ABC):
    """Per-worker factory of receivers; owns what transfers share (channels, threads).

    Registered with its transport in :data:`kvstore.transport.registry.TRANSPORTS`, built as
    ``cls(config, kv_config)``.

    Args:
        config: the transfer settings (backend, deadline, chunking).
        kv_config: the KV plane's token, TLS and gRPC message size (the KV store's config, so
            both ends of a channel agree). None: the defaults, no token and no TLS (stores
            without auth, tests).
    """

    name: str = ""

    def __init__(self, config: KVTransferConfig, kv_config: KVStoreConfig | None = None):
        self.config = config
        self.kv_config = kv_config if kv_config is not None else KVStoreConfig()

    @abstractmethod
    def create_receiver(self) -> KVReceiver:
        """A fresh receiver for one transfer."""

    def close(self) -> None:
        """Release shared resources (channels, thread pools). Idempotent."""
