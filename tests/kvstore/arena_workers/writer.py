"""Arena test worker: attaches to an arena after one JSON job on stdin and writes seeded
blocks into the given slots."""
import json, random, sys
from pdcluster.kvstore.arena.view import ArenaView
p = json.loads(sys.stdin.readline())
with ArenaView(p["name"], p["num_slots"], p["block_nbytes"]) as v:
    for slot, seed in zip(p["slots"], p["seeds"]):
        v.write(slot, random.Random(seed).randbytes(p["block_nbytes"]))
