"""Prefill forward time by the thread it runs on: the engine loop vs an RPC-style call thread.

    .venv/bin/python benchmarks/prefill_thread.py [--threads 2] [--tokens 512] [--repeats 10]

The 100M random-weight Llama of benchmarks/throughput.py, fp32, CPU, ``--threads`` torch
threads. Each placement runs in a fresh process (which thread used OpenMP first is
process-wide state):

* call thread (how the prefill actor ran before): the ModelRunner is built on the process's
  main thread; forwards run on another thread, as Ray's actor call threads do.
* model thread (the engine loop's way, engine/core/engine_loop.py): the ModelRunner is built
  on a new thread and every forward runs there.

Prints the median ``ModelRunner.execute`` time of one ``--tokens``-token chunk and the ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))


def _forward_ms(model_dir: str, threads: int, tokens: int, repeats: int,
                placement: str) -> float:
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.runner import ModelRunner, SequenceChunk

    config = EngineConfig(model=model_dir, torch_threads=threads, num_kv_blocks=tokens // 16 + 2,
                          max_num_batched_tokens=tokens)
    chunk = SequenceChunk(tuple(range(3, 3 + tokens)), 0, list(range(tokens // 16 + 1)))

    def timed(runner) -> float:
        runner.execute([chunk])  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.execute([chunk])
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    out: list[float] = []
    if placement == "model thread":
        call = threading.Thread(target=lambda: out.append(timed(ModelRunner(config))))
        call.start()
        call.join()
        return out[0]
    runner = ModelRunner(config)  # built on the main thread, forwards on another
    call = threading.Thread(target=lambda: out.append(timed(runner)))
    call.start()
    call.join()
    return out[0]


def _child(queue, *args) -> None:
    queue.put(_forward_ms(*args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    from benchmarks.throughput import FULL, write_model

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "random-llama"
        write_model(model_dir, FULL, 0)
        ms = {}
        for placement in ("call thread", "model thread"):
            queue = ctx.Queue()
            proc = ctx.Process(target=_child, args=(queue, str(model_dir), args.threads,
                                                    args.tokens, args.repeats, placement))
            proc.start()
            ms[placement] = queue.get(timeout=600)
            proc.join()
    print(f"{args.tokens}-token prefill chunk, 100M model, {args.threads} torch threads, "
          f"median of {args.repeats}:")
    for placement, value in ms.items():
        print(f"  {placement:12s} {value:8.1f} ms")
    print(f"  call thread / model thread: {ms['call thread'] / ms['model thread']:.2f}x")


if __name__ == "__main__":
    main()
