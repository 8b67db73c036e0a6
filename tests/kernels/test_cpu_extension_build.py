"""A build lock left by a killed build does not block later starts forever."""

from __future__ import annotations

import os
import time

from torch.utils.file_baton import FileBaton

from pdcluster.kernels.cpu_extension import STALE_LOCK_S, clear_stale_lock


def test_a_lock_left_by_a_dead_build_goes_and_a_live_builds_stays(tmp_path):
    lock = tmp_path / "lock"
    assert not clear_stale_lock(str(tmp_path))  # none there
    baton = FileBaton(str(lock))  # torch's own lock, as cpp_extension.load takes it
    assert baton.try_acquire()
    assert not clear_stale_lock(str(tmp_path))  # a build running now: left alone
    assert lock.exists()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))  # its build was killed long ago
    assert clear_stale_lock(str(tmp_path))
    assert not lock.exists()
    assert FileBaton(str(lock)).try_acquire()  # the next build takes it at once
