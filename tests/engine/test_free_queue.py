import random
import time

import pytest

from pdcluster.engine.core.free_queue import FreeBlockQueue


def test_starts_full_in_id_order_or_empty():
    q = FreeBlockQueue(5)
    assert len(q) == 5 and list(q) == [0, 1, 2, 3, 4]
    e = FreeBlockQueue(5, fill=False)
    assert len(e) == 0 and list(e) == [] and 3 not in e
    assert list(FreeBlockQueue(0)) == []


def test_popleft_takes_head_and_append_goes_to_tail():
    q = FreeBlockQueue(4)
    assert [q.popleft(), q.popleft()] == [0, 1]
    q.append(0)
    assert list(q) == [2, 3, 0] and len(q) == 3
    assert [q.popleft() for _ in range(3)] == [2, 3, 0]
    with pytest.raises(IndexError):
        q.popleft()
    q.append(3)
    assert list(q) == [3] and q.popleft() == 3


@pytest.mark.parametrize("victim, rest", [(2, [0, 1, 3, 4]), (0, [1, 2, 3, 4]), (4, [0, 1, 2, 3])])
def test_remove_from_middle_head_tail_then_reappend(victim, rest):
    q = FreeBlockQueue(5)
    q.remove(victim)
    assert list(q) == rest and len(q) == 4 and victim not in q
    q.append(victim)
    assert list(q) == rest + [victim] and victim in q
    assert [q.popleft() for _ in range(5)] == rest + [victim]


def test_remove_down_to_empty_and_rebuild():
    q = FreeBlockQueue(3)
    for b in (1, 2, 0):
        q.remove(b)
    assert len(q) == 0 and list(q) == []
    for b in (2, 0, 1):
        q.append(b)
    assert list(q) == [2, 0, 1]


def test_misuse_raises():
    q = FreeBlockQueue(3)
    with pytest.raises(ValueError):
        q.append(1)  # already queued
    q.remove(1)
    with pytest.raises(ValueError):
        q.remove(1)  # not queued
    for bad in (-1, 3):
        with pytest.raises(ValueError):
            q.append(bad)
        with pytest.raises(ValueError):
            q.remove(bad)
    assert list(q) == [0, 2]


def test_matches_a_list_model_under_random_ops():
    rng = random.Random(7)
    n = 50
    q, model = FreeBlockQueue(n), list(range(n))
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 and model:
            assert q.popleft() == model.pop(0)
        elif op < 0.6 and model:
            b = rng.choice(model)
            q.remove(b)
            model.remove(b)
        else:
            out = sorted(set(range(n)) - set(model))
            if out:
                b = rng.choice(out)
                q.append(b)
                model.append(b)
        assert len(q) == len(model)
    assert list(q) == model


def test_remove_from_middle_is_constant_time():
    # Sanity bound, not a benchmark: an O(n) list.remove over 200k ids would take far longer.
    # This thread's CPU time, not the wall clock: other processes on a loaded machine do not
    # count (the ops take ~10 ms of CPU; 10k O(n) removes over 100k ids take seconds).
    n = 200_000
    q = FreeBlockQueue(n)
    victims = random.Random(0).sample(range(n // 4, 3 * n // 4), 10_000)
    start = time.thread_time()
    for b in victims:
        q.remove(b)
    for b in victims:
        q.append(b)
    cpu_s = time.thread_time() - start
    assert len(q) == n
    assert cpu_s < 2.0, f"10k middle removes + appends took {cpu_s:.2f} s of CPU"
