"""A two-rank torch.distributed process group of its own, between one sender and one receiver.

torch.distributed's default group has one instance per
process, ``new_group`` is collective over it, and a dead peer hangs gloo for 30 min by
default. So a (prefill, decode) pair builds its process group object directly on its own
``TCPStore`` (``ProcessGroupGloo(store, rank, 2, options)`` on CPU, ``ProcessGroupNCCL`` on
CUDA), with a short timeout, and tears it down on any failure. Rank 0 (the sender) hosts the
store on a free port; rank 1 (the receiver) connects to it.

Setup over the store: rank 0 publishes a fresh nonce, its chunk size and its device; rank 1
answers HMAC-SHA256(token, nonce); rank 0 checks it (``hmac.compare_digest``) before the group
forms, so a peer without the KV plane's token never gets a group (the store itself is
unauthenticated: keep its ports on the cluster's trusted network, like Ray's).

NOTE (measured, torch 2.13): ``ProcessGroupGloo.abort()`` does not cancel a posted ``recv``
(a late send still lands in its buffer), and a gloo p2p work's ``is_completed()`` never turns
true without ``wait``. So the channel keeps every tensor of a posted op until the op completes
(a closed channel keeps them for good), and callers wait on their own thread.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import socket
import threading
from collections.abc import Callable

import pydantic
import torch
import torch.distributed as dist

from pdcluster.kvstore.errors import KVAuthError, KVStoreError, KVTransferError

_NONCE_KEY, _AUTH_KEY, _CHUNK_KEY, _DEVICE_KEY = "nonce", "auth", "chunk_bytes", "device"


def _gloo_group(store: dist.Store, rank: int, local_addr: str,
                timeout: datetime.timedelta) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_addr)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _nccl_group(store: dist.Store, rank: int, local_addr: str,
                timeout: datetime.timedelta) -> dist.ProcessGroup:
    if not dist.is_nccl_available():
        raise KVTransferError("NCCL is not available in this torch build")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, options)


#: Device type -> builder of the pair's process group.
PAIR_GROUP_BUILDERS: dict[str, Callable[..., dist.ProcessGroup]] = {
    "cpu": _gloo_group, "cuda": _nccl_group,
}


class TorchPairChannel:
    """A two-rank process group on its own TCPStore, between one sender and one receiver.

    Args:
        rank: 0 for the sender (hosts the store at ``master_addr:master_port``; port 0 picks a
            free one, see :attr:`address`), 1 for the receiver.
        master_addr: the sender's routable address (never a wildcard: gloo advertises it; rank
            1 advertises its local address that routes to it).
        master_port: the store's port (rank 1: the port rank 0 published).
        timeout_s: limit of the setup and default limit of each send/recv, in seconds.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL); rank 1 learns it from rank 0.
        token: shared secret; rank 1 must prove it knows rank 0's (HMAC over a fresh nonce).
        chunk_bytes: rank 0: bytes per send/recv, published to rank 1.

    Raises:
        KVTransferError: rank 0 cannot bind the store.
    """

    def __init__(self, rank: int, master_addr: str, master_port: int = 0,
                 timeout_s: float = 10.0, device: str = "cpu",
                 token: str | pydantic.SecretStr | None = None, chunk_bytes: int = 4 << 20):
        if rank not in (0, 1):
            raise ValueError(f"a pair channel has ranks 0 and 1, got {rank}")
        if device not in PAIR_GROUP_BUILDERS:
            raise ValueError(f"device must be one of {sorted(PAIR_GROUP_BUILDERS)}, got {device}")
        self.rank, self.master_addr, self.timeout_s = rank, master_addr, timeout_s
        self.device, self.chunk_bytes = device, chunk_bytes
        self._token = token.get_secret_value() if isinstance(token, pydantic.SecretStr) else token
        self._lock = threading.Lock()
        self._group: dist.ProcessGroup | None = None
        self._closed = False
        self._inflight: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # see the module NOTE
        self._store: dist.Store | None = None
        self._port = master_port
        if rank == 0:
            try:
                self._store = dist.TCPStore(master_addr, master_port, 2, True,
                                            timeout=self._timedelta(timeout_s),
                                            wait_for_workers=False)
            except (RuntimeError, dist.DistError) as exc:
                raise KVTransferError(f"cannot bind pair store on {master_addr}:{master_port}: "
                                      f"{exc}", address=f"{master_addr}:{master_port}") from None
            self._port = self._store.port
            self._store.set(_NONCE_KEY, os.urandom(16).hex())
            self._store.set(_CHUNK_KEY, str(chunk_bytes))
            self._store.set(_DEVICE_KEY, device)

    @property
    def address(self) -> str:
        """``host:port`` of the pair store (what rank 1 connects to)."""
        host = self.master_addr
        return f"[{host}]:{self._port}" if ":" in host else f"{host}:{self._port}"

    @property
    def connected(self) -> bool:
        """The group is formed and not torn down."""
        return self._group is not None and not self._closed

    @property
    def closed(self) -> bool:
        """Torn down (after a failure or :meth:`close`); never reused."""
        return self._closed

    def connect(self) -> None:
        """Form the pair group; blocks until the peer joins. Idempotent, thread-safe.

        Raises:
            KVTransferError: the peer did not join within ``timeout_s``, or the channel is
                closed; the channel is then closed.
            KVAuthError: the peer's token proof is wrong (rank 0) or missing.
        """
        with self._lock:
            if self._closed:
                raise KVTransferError(f"pair channel {self.address} is closed",
                                      address=self.address)
            if self._group is not None:
                return
            try:
                self._group = self._form_group()
            except KVStoreError:
                self._close_locked()
                raise
            except (RuntimeError, ValueError, dist.DistError) as exc:
                self._close_locked()
                raise KVTransferError(f"pair channel {self.address} (rank {self.rank}) could not "
                                      f"connect within {self.timeout_s} s: {_first_line(exc)}",
                                      address=self.address) from None

    def send(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        """Post a send of contiguous ``tensor`` to the peer; ``wait`` on the returned work.

        ``tensor`` is kept alive by the channel until the send completes (or for good)."""
        return self._post(tensor, lambda g: g.send([tensor], 1 - self.rank, tag))

    def recv(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        """Post a receive into contiguous ``tensor`` from the peer; ``wait`` on the work.

        ``tensor`` is kept alive by the channel until the receive completes (or for good)."""
        return self._post(tensor, lambda g: g.recv([tensor], 1 - self.rank, tag))

    def wait(self, work: dist.Work, timeout_s: float) -> None:
        """Wait for ``work`` at most ``timeout_s``.

        Raises:
            KVTransferError: timeout or peer failure; the caller should :meth:`close`.
        """
        try:
            work.wait(self._timedelta(timeout_s))
        except (RuntimeError, dist.DistError) as exc:
            raise KVTransferError(f"pair channel {self.address}: {_first_line(exc)}",
                                  address=self.address) from None
        with self._lock:
            self._inflight.pop(id(work), None)

    def close(self) -> None:
        """Tear the group down (abort) and drop the store. Idempotent."""
        with self._lock:
            self._close_locked()

    # ---- internals --------------------------------------------------------------------

    def _post(self, tensor: torch.Tensor,
              op: Callable[[dist.ProcessGroup], dist.Work]) -> dist.Work:
        with self._lock:
            group = self._group
            if group is None or self._closed:
                raise KVTransferError(f"pair channel {self.address} is not connected",
                                      address=self.address)
            try:
                work = op(group)
            except (RuntimeError, dist.DistError) as exc:
                raise KVTransferError(f"pair channel {self.address}: {_first_line(exc)}",
                                      address=self.address) from None
            self._inflight[id(work)] = (work, tensor)
            return work

    def _form_group(self) -> dist.ProcessGroup:
        timeout = self._timedelta(self.timeout_s)
        if self.rank == 1:
            self._store = dist.TCPStore(self.master_addr, self._port, 2, False, timeout=timeout)
        store = self._store
        assert store is not None
        nonce = store.get(_NONCE_KEY)
        if self.rank == 1:
            self.chunk_bytes = int(store.get(_CHUNK_KEY))
            self.device = store.get(_DEVICE_KEY).decode()
            if self.device not in PAIR_GROUP_BUILDERS:
                raise KVTransferError(f"pair channel {self.address}: unknown device "
                                      f"{self.device!r}", address=self.address)
            store.set(_AUTH_KEY, _proof(self._token, nonce))
        else:
            store.wait([_AUTH_KEY], timeout)
            if not hmac.compare_digest(store.get(_AUTH_KEY), _proof(self._token, nonce)):
                raise KVAuthError(f"pair channel {self.address}: the peer's token is wrong",
                                  address=self.address)
        local = self.master_addr if self.rank == 0 else _route_to(self.master_addr)
        return PAIR_GROUP_BUILDERS[self.device](dist.PrefixStore("pg/", store), self.rank,
                                                local, timeout)

    def _close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        group, self._group, self._store = self._group, None, None
        if group is not None:
            try:
                group.abort()
            except RuntimeError:
                pass  # already broken

    @staticmethod
    def _timedelta(seconds: float) -> datetime.timedelta:
        return datetime.timedelta(seconds=max(seconds, 0.001))


def _proof(token: str | None, nonce: bytes) -> bytes:
    key = (token or "").encode()
    return hmac.new(key, b"pdcluster-kv-pair/" + nonce, hashlib.sha256).hexdigest().encode()


def _route_to(host: str) -> str:
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
