"""Arena test worker: attaches to an arena after one JSON job on stdin, reads the given slots
and prints their sha256 digests as JSON."""
import hashlib, json, sys, torch
from pdcluster.kvstore.arena.view import ArenaView
p = json.loads(sys.stdin.readline())
out = torch.empty(len(p["slots"]), p["block_nbytes"], dtype=torch.uint8)
with ArenaView(p["name"], p["num_slots"], p["block_nbytes"]) as v:
    v.read_into(p["slots"], out)
print(json.dumps([hashlib.sha256(r.numpy().tobytes()).hexdigest() for r in out]))
