"""G2 (host DRAM) tier, worker side: direct reads and writes of the node's shared-memory arena.

A worker attaches to the segment its node's :class:`kvstore.arena.owner.HostArena` created,
given ``(shm_name, num_slots, block_nbytes)`` over RPC, and copies block bytes itself; it asks
the owner for leases (``reserve``/``commit``, ``acquire``/``release``) and touches only the slots
it holds, so a block is never read while another process writes it.

Attaching never registers the segment with ``multiprocessing.resource_tracker``. Python < 3.13's
``SharedMemory(name=...)`` registers every attach, so a worker's exit unlinks the owner's segment
and warns of a "leaked" object; the usual fix (``resource_tracker.unregister`` after attaching)
breaks a ``spawn``/``fork`` child, which shares its parent's tracker: it erases the owner's
registration, and the owner's own unlink then makes the tracker raise ``KeyError`` (both seen on
3.11.7). Nor does it use ``SharedMemory.close``, which unmaps the memory under tensors that
``torch.frombuffer`` made: those hold a reference to the buffer object, not a buffer export,
so they would dangle. Here the segment is opened with ``shm_open`` + ``mmap`` (what
``SharedMemory`` does inside, minus the tracker; kvstore/arena/segment.py) on every Python
version, instead of 3.13's ``track=False``, and unmapped only when the last tensor viewing it is
freed.

CUDA: with CUDA available the whole mapping is page-locked with ``cudaHostRegister``
(``cudaHostRegisterPortable``), so host<->device copies of slots are DMA and can be
``non_blocking``. Registering is per process and costs time proportional to the arena size.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence

import torch

from pdcluster.kvstore.arena.errors import ArenaClosedError
from pdcluster.kvstore.arena.segment import attach_segment

_CUDA_HOST_REGISTER_PORTABLE = 1
#: CPU copies of fewer runs of consecutive slots use one memmove per run, more use one
#: index_select / index_copy_ (measured crossover for 4-64 KiB slots, benchmarks/shm_read.py).
_GATHER_MIN_RUNS = 16


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce slots into runs of consecutive slot numbers: ``(first_slot, first_index,
    length)``, where ``first_index`` is the run's position in ``slots``. ``[4, 5, 6, 2, 3]``
    gives ``[(4, 0, 3), (2, 3, 2)]``: one copy per run (SGLang groups contiguous pages)."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs:
            first, start, length = runs[-1]
            if slot == first + length:
                runs[-1] = (first, start, length + 1)
                continue
        runs.append((slot, i, 1))
    return runs


class ArenaView:
    """A worker's mapping of a node's host arena.

    Args:
        shm_name: ``HostArena.shm_name``.
        num_slots, block_nbytes: ``HostArena.num_slots`` / ``.block_nbytes``.

    The mapping is page-locked for CUDA (``cudaHostRegister``) when ``torch.cuda.is_available()``.

    Raises:
        ArenaAttachError: the segment does not exist (owner closed it, other node), is smaller
            than ``num_slots * block_nbytes``, or POSIX shared memory is unavailable.
        ValueError: ``num_slots`` or ``block_nbytes`` <= 0.
        torch.cuda.CudaError: page-locking fails.

    Never unlinks the segment. Touch only slots you hold a lease on: others are being written or
    may be reused at any moment.
    """

    def __init__(self, shm_name: str, num_slots: int, block_nbytes: int) -> None:
        if num_slots <= 0 or block_nbytes <= 0:
            raise ValueError(f"num_slots={num_slots}, block_nbytes={block_nbytes}: must be > 0")
        self._name = shm_name
        self._num_slots = num_slots
        self._block_nbytes = block_nbytes
        size = num_slots * block_nbytes
        self._mmap: mmap.mmap | None = attach_segment(shm_name, size)
        arena = torch.frombuffer(self._mmap, dtype=torch.uint8, count=size)
        self._slots: torch.Tensor | None = arena.view(num_slots, block_nbytes)
        self._pinned_ptr: int | None = None
        if torch.cuda.is_available():
            ptr = arena.data_ptr()
            torch.cuda.check_error(
                int(torch.cuda.cudart().cudaHostRegister(ptr, size, _CUDA_HOST_REGISTER_PORTABLE))
            )
            self._pinned_ptr = ptr

    def read(self, slot: int) -> torch.Tensor:
        """Zero-copy view of a slot: uint8, shape ``(block_nbytes,)``, aliasing shared memory.

        Its contents are the block's only while you hold the slot's lease; writes to it write
        the arena. It stays mapped (never dangles) even after :meth:`close`.
        """
        return self._slot_tensor()[self._check(slot)]

    def write(self, slot: int, data: bytes | bytearray | memoryview | torch.Tensor) -> None:
        """Copy one block into ``slot``. ``data`` is C-contiguous, exactly ``block_nbytes`` bytes
        (a tensor of any dtype and device; from CUDA the copy is synchronous).

        Raises:
            ValueError: wrong size, non-contiguous data, or slot out of range.
        """
        if isinstance(data, torch.Tensor):
            self._copy([self._check(slot)], data, into_arena=True)
            return
        self._slot_tensor()
        src = memoryview(data).cast("B")
        if src.nbytes != self._block_nbytes:
            raise ValueError(f"block is {src.nbytes} bytes, slots are {self._block_nbytes}")
        start = self._check(slot) * self._block_nbytes
        self._mmap[start : start + self._block_nbytes] = src  # type: ignore[index]

    def read_into(self, slots: Sequence[int], out: torch.Tensor) -> None:
        """Copy ``slots`` in order into ``out``: contiguous, any dtype and device, exactly
        ``len(slots) * block_nbytes`` bytes. One copy per run of consecutive slots (on the CPU one
        gather when there are many runs); to a CUDA ``out`` from a pinned view the copies are
        ``non_blocking`` (synchronize before use).

        Raises:
            ValueError: wrong size, non-contiguous ``out``, or a slot out of range.
        """
        self._copy(slots, out, into_arena=False)

    def write_from(self, slots: Sequence[int], src: torch.Tensor) -> None:
        """Copy ``src`` (contiguous, any dtype and device, ``len(slots) * block_nbytes`` bytes)
        into ``slots`` in order; the inverse of :meth:`read_into`. ``slots`` must not repeat. From
        CUDA the copies are synchronous: the bytes are in the arena on return, ready to commit.

        Raises:
            ValueError: wrong size, non-contiguous ``src``, or a slot out of range.
        """
        self._copy(slots, src, into_arena=True)

    def close(self) -> None:
        """Unregister the CUDA pinning and drop this view's mapping. Idempotent; never unlinks.

        The memory is unmapped once no tensor from :meth:`read` is alive. Synchronize pending
        ``non_blocking`` copies first.
        """
        if self._pinned_ptr is not None:
            torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)))
            self._pinned_ptr = None
        self._slots = None
        self._mmap = None

    def __enter__(self) -> ArenaView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _slot_tensor(self) -> torch.Tensor:
        if self._slots is None:
            raise ArenaClosedError(f"view of host arena {self._name} is closed")
        return self._slots

    def _copy(self, slots: Sequence[int], t: torch.Tensor, *, into_arena: bool) -> None:
        nbytes = self._block_nbytes
        if not t.is_contiguous():
            raise ValueError("tensor must be contiguous")
        if t.numel() * t.element_size() != len(slots) * nbytes:
            raise ValueError(
                f"tensor is {t.numel() * t.element_size()} bytes, expected {len(slots) * nbytes}"
            )
        arena = self._slot_tensor()  # a local reference keeps the mapping alive while copying
        runs = self._runs(slots)
        if t.is_cpu and len(runs) < _GATHER_MIN_RUNS:
            # NOTE: a memmove per run costs ~0.5 us of Python where torch slicing + copy_ costs
            # ~5 us, which dominates small requests (benchmarks/shm_read.py). Bounds are checked
            # above; ctypes releases the GIL during each copy.
            base, ptr = arena.data_ptr(), t.data_ptr()
            for first, start, n in runs:
                at_arena, at_t = base + first * nbytes, ptr + start * nbytes
                dst, src = (at_arena, at_t) if into_arena else (at_t, at_arena)
                ctypes.memmove(dst, src, n * nbytes)
            return
        rows = t.reshape(-1).view(torch.uint8).view(-1, nbytes)
        if t.is_cpu:  # many short runs: one gather/scatter in C beats a Python loop
            index = torch.tensor(slots, dtype=torch.int64)
            if into_arena:
                arena.index_copy_(0, index, rows)
            else:
                torch.index_select(arena, 0, index, out=rows)
            return
        non_blocking = self._pinned_ptr is not None
        for first, start, n in runs:
            if into_arena:
                arena[first : first + n].copy_(rows[start : start + n])
            else:
                rows[start : start + n].copy_(arena[first : first + n], non_blocking=non_blocking)

    def _check(self, slot: int) -> int:
        if not 0 <= slot < self._num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self._num_slots - 1}")
        return slot

    def _runs(self, slots: Sequence[int]) -> list[tuple[int, int, int]]:
        if slots and not (0 <= min(slots) and max(slots) < self._num_slots):
            raise ValueError(f"slots out of range 0..{self._num_slots - 1}")
        return slot_runs(slots)
