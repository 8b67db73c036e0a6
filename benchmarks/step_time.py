"""One engine step of the 100M random Llama (throughput.py's model) against the memory roofline.

Prints the read bandwidth (a sum over 1 GiB at the engine's thread count, bytes read per
second), the weight-read bound of a decode step (weight bytes / bandwidth), and the measured
ModelRunner.execute time of decode batches (context 600 tokens each) and of a 512-token
prefill, median of repeated runs.

    python benchmarks/step_time.py [--threads 2] [--batches 1,4,32] [--repeats 10]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # after the repo: benchmarks/kernels.py

from engine.config import EngineConfig  # noqa: E402
from engine.runner import ModelRunner, SequenceChunk  # noqa: E402
from cpu_attention import median_s  # noqa: E402
from throughput import FULL, write_model  # noqa: E402

CONTEXT = 600
BLOCKS_PER_SEQ = 40


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of a float32 sum over `nbytes`."""
    x = torch.ones(nbytes // 4)
    x.sum()
    start = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    return repeats * nbytes / (time.perf_counter() - start)


def median_ms(fn, repeats: int) -> float:
    return median_s(fn, repeats) * 1000


def measure(threads: int, batches: list[int], repeats: int) -> dict:
    """Read bandwidth (bytes/s), weight bytes, the weight-read bound (ms) and the median
    execute time (ms) of each decode batch and of a 512-token prefill, at `threads`."""
    torch.set_num_threads(threads)
    bandwidth = read_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "random-llama"
        write_model(model_dir, FULL, 0)
        runner = ModelRunner(EngineConfig(model=str(model_dir), num_kv_blocks=2664,
                                          torch_threads=threads))
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    decode = {}
    for batch in batches:
        chunks = [SequenceChunk([5], CONTEXT, list(range(i * BLOCKS_PER_SEQ,
                                                          (i + 1) * BLOCKS_PER_SEQ)))
                  for i in range(batch)]
        decode[batch] = median_ms(lambda: runner.execute(chunks), repeats)
    prompt = [SequenceChunk(list(range(3, 515)), 0, list(range(2000, 2032)))]
    return {"bandwidth": bandwidth, "weight_bytes": weight_bytes,
            "bound_ms": weight_bytes / bandwidth * 1000, "decode_ms": decode,
            "prefill_ms": median_ms(lambda: runner.execute(prompt), 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,4,32")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    result = measure(args.threads, [int(b) for b in args.batches.split(",")], args.repeats)
    bound = result["bound_ms"]
    print(f"read bandwidth {result['bandwidth'] / 1e9:.1f} GB/s ({args.threads} threads); "
          f"weights {result['weight_bytes'] / 1e6:.0f} MB -> decode step bound {bound:.1f} ms")
    for batch, ms in result["decode_ms"].items():
        print(f"decode batch {batch:3d}: {ms:7.1f} ms  ({ms / bound:.2f}x the bound)")
    print(f"prefill 512 tokens: {result['prefill_ms']:.1f} ms")


if __name__ == "__main__":
    main()
