"""Arena test worker: an arena owner (no torch) spawns a child with multiprocessing, which
shares the owner's resource tracker, then checks the child's bytes through its own mapping;
prints "ok". Reads the node id from stdin."""
import multiprocessing as mp, random, sys
from pdcluster.kvstore.arena import HostArena
from pdcluster.kvstore.arena.segment import attach_segment
CHILD = '''
import random
from pdcluster.kvstore.arena.view import ArenaView
with ArenaView(NAME, 2, 4096) as v:
    v.write(SLOT, random.Random(7).randbytes(4096))
'''
if __name__ == "__main__":  # a spawn child imports this module: it must not re-run it
    a = HostArena(2 * 4096, 4096, node_id=sys.stdin.readline().strip())
    [slot] = a.reserve([b"k"])
    p = mp.get_context("spawn").Process(target=exec, args=(CHILD, {"NAME": a.shm_name, "SLOT": slot}))
    p.start()
    p.join()
    assert p.exitcode == 0
    a.commit([b"k"], [slot])
    [s] = a.acquire([b"k"])
    m = attach_segment(a.shm_name, 2 * 4096)
    assert m[s * 4096 : (s + 1) * 4096] == random.Random(7).randbytes(4096)
    a.release([s])
    a.close()
    print("ok")
