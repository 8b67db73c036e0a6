"""Which CPU cores a worker's torch threads run on, and pinning them there.

A worker engine on CPU runs its ops on an OpenMP team of `torch_threads` threads that meet at
a barrier after every op, so one thread moved to a busy core, or sharing its core with
another team, stalls the whole team. Each worker therefore claims cores of its own on its
node and pins its team one thread per core, as vLLM's CPU backend binds its OpenMP threads.

Claims are node-local and need no coordinator: core N is claimed by holding an exclusive
`flock` on the file `cpu-N.lock` in a directory shared by the node's processes. The kernel
drops the lock when the holder dies, however it dies, so a killed worker's cores are free for
its replacement. A worker that finds too few free cores warns and runs unpinned rather than
doubling up on a claimed core.

Cores are handed out physical core first: the first hardware thread of every core, then
their SMT siblings, so a two-thread team does not land on the two halves of one core.

A node's launcher may set cores aside for the workers by writing them, as a cpu list, to the
file `workers` in the same directory (`CoreClaims.set_worker_cores`; the images' entrypoint
does, deploy/node_cores.py). "auto" then claims from those. This is how a Kubernetes pod keeps
Ray's own processes off the engines' cores: Ray runs confined to the rest, and its workers,
which inherit that confinement, still find the cores meant for them, whatever ids the pod's
cpuset has.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
#: `engine.cpu_bind` values other than a cpu list
AUTO, NONE = "auto", "none"


def parse_cpu_list(text: str) -> list[int]:
    """CPU ids of a Linux cpu list ("0-3,8,10-11", as taskset and cgroups write them), sorted
    and without repeats. Raises ValueError for anything else, or a range that runs backwards."""
    text = text.replace(" ", "")
    if not _CPU_LIST.match(text):
        raise ValueError(f"not a cpu list (e.g. '0-3,8'): {text!r}")
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"cpu range {part!r} runs backwards")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The shortest cpu list naming `cpus` ([0, 1, 2, 5] -> "0-2,5")."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def validate_cpu_bind(value: str) -> str:
    """`value` when it is "auto", "none" or a cpu list; raises ValueError otherwise."""
    if value not in (AUTO, NONE):
        parse_cpu_list(value)
    return value


def physical_first(cpus: Iterable[int]) -> list[int]:
    """`cpus` ordered so that the first hardware thread of each physical core comes before
    any SMT sibling (Linux sysfs topology; the plain order where sysfs does not say)."""
    rank: dict[int, tuple[int, int]] = {}
    for cpu in cpus:
        siblings = _read_cpu_list(
            f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        position = siblings.index(cpu) if siblings and cpu in siblings else 0
        rank[cpu] = (position, cpu)
    return sorted(rank, key=rank.__getitem__)


def split_node_cores(worker_threads: int,
                     cores: Sequence[int]) -> tuple[list[int], list[int]] | None:
    """Split one node's `cores` into (the workers' cores, the rest) when there are more cores
    than `worker_threads`, the torch threads of every worker the node runs. The workers get
    whole physical cores first. None when the cores do not outnumber the threads: then
    nothing is set aside and the workers claim from all of them."""
    ordered = physical_first(cores)
    if worker_threads <= 0 or len(ordered) <= worker_threads:
        return None
    return sorted(ordered[:worker_threads]), sorted(ordered[worker_threads:])


class CoreClaims:
    """The cores this process holds on its node (module docstring), one lock file each.

    `directory` is where the lock files live; every process of a node must use the same one
    (the default: /dev/shm where it exists, else the system temp dir)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or _default_directory()
        self._held: dict[int, int] = {}  # cpu -> fd of its locked file
        self._lock = threading.Lock()

    @property
    def cpus(self) -> list[int]:
        return sorted(self._held)

    def worker_cores(self) -> list[int] | None:
        """The cores the node's launcher set aside for the workers (`set_worker_cores`), or
        None where it set none (or the file does not hold a cpu list)."""
        return _read_cpu_list(str(self.directory / "workers")) or None

    def set_worker_cores(self, cpus: Iterable[int]) -> None:
        """Declare `cpus` the node's workers' cores: "auto" claims from them from now on.
        Written whole (a rename), so a reader never sees half a list."""
        self._ensure_directory()
        path = self.directory / "workers"
        staged = path.with_name(f"workers.{os.getpid()}")
        staged.write_text(format_cpu_list(cpus) + "\n")
        os.replace(staged, path)

    def claim(self, count: int, pool: Sequence[int]) -> list[int] | None:
        """Claim `count` cores of `pool`, taken in `physical_first` order, releasing the cores
        held before. Returns them sorted, or None (holding nothing) when fewer than `count`
        are free."""
        with self._lock:
            self._release()
            self._ensure_directory()
            for cpu in physical_first(pool):
                if len(self._held) == count:
                    break
                fd = os.open(self.directory / f"cpu-{cpu}.lock", os.O_RDWR | os.O_CREAT, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._held[cpu] = fd
            if len(self._held) < count:
                self._release()
                return None
            return self.cpus

    def _ensure_directory(self) -> None:
        if not self.directory.is_dir():  # shared by every user's workers, as /tmp is
            self.directory.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # another user made it first
                os.chmod(self.directory, 0o1777)

    def release(self) -> None:
        """Give back every core this process holds."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        for fd in self._held.values():
            os.close(fd)  # closing the file drops its flock
        self._held.clear()


_claims: CoreClaims | None = None


def bind_threads(cpu_bind: str, threads: int, claims: CoreClaims | None = None) -> list[int] | None:
    """Claim `threads` cores and pin this thread's OpenMP team to them, one thread per core.

    Call it on the thread that runs the engine's ops, after torch.set_num_threads(threads):
    that thread becomes the team's first member and is pinned too.
    cpu_bind: "none" (pin nothing), "auto" (claim from the node's worker cores where its
        launcher declared them, `CoreClaims.worker_cores`, else from the cores this process
        may run on) or a cpu list (claim from those: the cores a launcher set aside for the
        node's workers).
    claims: the registry to claim in (default: one per process).
    Returns the cores, sorted, or None when nothing was pinned: "none", or too few free cores
    (logged as a warning). Raises ValueError for a malformed cpu_bind.
    """
    global _claims
    validate_cpu_bind(cpu_bind)
    if cpu_bind == NONE or not hasattr(os, "sched_setaffinity"):  # Linux only
        return None
    if claims is None:
        _claims = _claims or CoreClaims()
        claims = _claims
    if cpu_bind == AUTO:
        pool = claims.worker_cores() or sorted(os.sched_getaffinity(0))
    else:
        pool = parse_cpu_list(cpu_bind)
    cpus = claims.claim(threads, pool)
    if cpus is None:
        log.warning("cpu binding: fewer than %d of cores %s are free on this node; this "
                    "worker's threads run unpinned", threads, format_cpu_list(pool))
        return None
    ordered = physical_first(cpus)
    from pdcluster.kernels import cpu_extension  # here: config validation needs no torch

    extension = cpu_extension.module()
    try:
        if extension is not None:
            if min(extension.bind_omp_threads(ordered)) < 0:
                raise OSError("sched_setaffinity refused a core")
        else:  # no compiler: the team stays on these cores, if not one thread per core
            os.sched_setaffinity(0, ordered)
    except OSError as exc:  # a listed core outside this process's cgroup, for one
        claims.release()
        log.warning("cpu binding: cannot pin to cores %s (%s); this worker's threads run "
                    "unpinned", format_cpu_list(cpus), exc)
        return None
    log.info("torch threads pinned to cores %s", format_cpu_list(cpus))
    return cpus


def _default_directory() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / "pdcluster-cpu-claims"


def _read_cpu_list(path: str) -> list[int]:
    try:
        return parse_cpu_list(Path(path).read_text().strip())
    except (OSError, ValueError):
        return []
