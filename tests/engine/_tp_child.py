"""Child process of test_tensor_parallel: one rank of a TP instance (gloo, CPU), or TP=1.

    python _tp_child.py RANK WORLD MODEL BLOCK_SIZE OUT_DIR MODE [PORT]

Rank 0 creates the master TCPStore on a free port and writes it to OUT_DIR/port; the other
ranks get PORT. Rank 0 (or TP=1) runs `scenario` and writes OUT_DIR/result.json and
OUT_DIR/wire.pt; every rank writes OUT_DIR/rank{r}.json (its parameter bytes, KV heads).
MODE "serve": the scenario; "die": rank 1 exits before following, rank 0 reports the error.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.parallel import TPError, create_master_store, init_tp_group
from pdcluster.engine.runner import ModelRunner, SequenceChunk

NUM_BLOCKS = 48
DECODE_STEPS = 10


def scenario(runner: ModelRunner, block_size: int) -> tuple[dict, torch.Tensor]:
    """Chunked + batched prefill, batched greedy decode, then the prompt's blocks read in the
    KV pool's layout (gathered), written into other blocks (scattered) and decoded again."""
    vocab = runner.model_config.vocab_size
    rng = random.Random(7)
    a = [1] + [rng.randrange(3, vocab) for _ in range(2 * block_size + 2)]
    b = [1] + [rng.randrange(3, vocab) for _ in range(block_size + 1)]
    span = -(-(len(a) + DECODE_STEPS + 1) // block_size)
    order = list(range(NUM_BLOCKS))
    random.Random(3).shuffle(order)
    table_a, table_b, table_c = order[:span], order[span:2 * span], order[2 * span:3 * span]
    tp = runner.tp
    runner.execute([SequenceChunk(a[:5], 0, table_a)])
    before = tp.num_all_reduces
    logits = runner.execute([SequenceChunk(a[5:], 5, table_a), SequenceChunk(b, 0, table_b)])
    prefill_all_reduces = tp.num_all_reduces - before
    first_logits = logits.clone()
    seqs = [a + [int(logits[0].argmax())], b + [int(logits[1].argmax())]]
    prompt_blocks = -(-len(a) // block_size)
    wire = runner.wire_kv.read_blocks(table_a[:prompt_blocks]).clone()
    step_all_reduces = []
    for _ in range(DECODE_STEPS):
        before = tp.num_all_reduces
        logits = runner.execute([SequenceChunk(s[-1:], len(s) - 1, t)
                                 for s, t in zip(seqs, (table_a, table_b))])
        step_all_reduces.append(tp.num_all_reduces - before)
        for s, row in zip(seqs, logits):
            s.append(int(row.argmax()))
    # the decode side of a transfer: full-head blocks in, each rank keeps its heads
    runner.wire_kv.write_blocks(table_c[:prompt_blocks], wire)
    migrated = a + [seqs[0][len(a)]]
    for _ in range(DECODE_STEPS):
        logits = runner.execute([SequenceChunk(migrated[-1:], len(migrated) - 1, table_c)])
        migrated.append(int(logits[0].argmax()))
    result = {
        "outputs": [s[len(p):] for s, p in zip(seqs, (a, b))],
        "migrated": migrated[len(a):],
        "prefill_all_reduces": prefill_all_reduces,
        "step_all_reduces": step_all_reduces,
        "first_logits": first_logits.tolist(),
        "wire_spec": [[r.tensor.name, list(r.tensor.shape)] for r in runner.wire_kv.spec.regions],
    }
    return result, wire


def rank_report(runner: ModelRunner) -> dict:
    layers = runner.model.model.layers
    return {
        "layer_param_bytes": sum(p.numel() * p.element_size() for p in layers.parameters()),
        "kv_heads": runner.kv_cache.k[0].shape[2],
        "num_attention_heads": layers[0].self_attn.num_heads,
    }


def main() -> None:
    rank, world, model, block_size, out, mode = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                                 int(sys.argv[4]), Path(sys.argv[5]), sys.argv[6])
    store = None
    port = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    if rank == 0 and world > 1:
        store = create_master_store("127.0.0.1", world, timeout_s=60)
        port = store.port
        (out / "port.tmp").write_text(str(port))
        (out / "port.tmp").rename(out / "port")
    tp = init_tp_group(rank, world, "127.0.0.1", port, "cpu", timeout_s=60, store=store)
    config = EngineConfig(model=model, block_size=block_size, num_kv_blocks=NUM_BLOCKS,
                          tensor_parallel_size=world)
    runner = ModelRunner(config, tp=tp)
    (out / f"rank{rank}.json").write_text(json.dumps(rank_report(runner)))
    if mode == "die":
        if rank == 1:
            os._exit(3)
        time.sleep(1.0)
        errors = []
        for _ in range(2):
            start = time.monotonic()
            try:
                runner.execute([SequenceChunk([1, 5, 6], 0, [0])])
                errors.append(["no error", time.monotonic() - start])
            except TPError as exc:
                errors.append([str(exc), time.monotonic() - start])
        (out / "result.json").write_text(json.dumps({"errors": errors}))
        os._exit(0)  # the group's other member is gone: skip torch's teardown
    if rank == 0:
        result, wire = scenario(runner, block_size)
        runner.close()
        torch.save(wire, out / "wire.pt")
        (out / "result.json").write_text(json.dumps(result))
    else:
        runner.follow()
    os._exit(0)  # skip the process group's teardown at exit


if __name__ == "__main__":
    main()
