"""One engine step of the 100M random Llama (throughput.py's model) against the memory roofline.

Prints the read bandwidth (a sum over 1 GiB at the engine's thread count, bytes read per
second), the weight-read bound of a decode step (weight bytes / bandwidth), and the measured
ModelRunner.execute time of decode batches (context 600 tokens each) and of a 512-token
prefill, median of repeated runs, for each forward mode asked for (the compiled forward,
engine.compilation, and the eager one; measurements of the modes alternate).

    python benchmarks/step_time.py [--threads 2] [--batches 1,4,32] [--repeats 10]
                                   [--modes compiled,eager]
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


def measure(threads: int, batches: list[int], repeats: int,
            modes: tuple[str, ...] = ("eager",)) -> dict:
    """Read bandwidth (bytes/s), weight bytes, the weight-read bound (ms), and per forward
    mode ("compiled" | "eager") the median execute time (ms) of each decode batch and of a
    512-token prefill, at `threads`. Raises RuntimeError if a compiled runner fell back to
    eager."""
    torch.set_num_threads(threads)
    bandwidth = read_bandwidth()
    runners = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "random-llama"
        write_model(model_dir, FULL, 0)
        for mode in modes:
            started = time.perf_counter()
            runners[mode] = ModelRunner(EngineConfig(
                model=str(model_dir), num_kv_blocks=2664, torch_threads=threads,
                enforce_eager=mode == "eager"))
            if runners[mode].forward_mode != mode:
                raise RuntimeError(f"asked for a {mode} forward, got {runners[mode].forward_mode}")
            print(f"{mode} runner ready in {time.perf_counter() - started:.1f} s")
    first = runners[modes[0]]
    weight_bytes = sum(p.numel() * p.element_size() for p in first.model.parameters())
    decode: dict[str, dict[int, float]] = {mode: {} for mode in modes}
    for batch in batches:
        chunks = [SequenceChunk([5], CONTEXT, list(range(i * BLOCKS_PER_SEQ,
                                                          (i + 1) * BLOCKS_PER_SEQ)))
                  for i in range(batch)]
        for mode, runner in runners.items():
            decode[mode][batch] = median_ms(lambda: runner.execute(chunks), repeats)
    prompt = [SequenceChunk(list(range(3, 515)), 0, list(range(2000, 2032)))]
    prefill = {mode: median_ms(lambda: runner.execute(prompt), 5)
               for mode, runner in runners.items()}
    return {"bandwidth": bandwidth, "weight_bytes": weight_bytes,
            "bound_ms": weight_bytes / bandwidth * 1000, "decode_ms": decode,
            "prefill_ms": prefill}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,4,32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--modes", default="compiled,eager",
                        help="forward modes to measure, alternating: compiled, eager")
    args = parser.parse_args()
    modes = tuple(args.modes.split(","))
    result = measure(args.threads, [int(b) for b in args.batches.split(",")], args.repeats,
                     modes)
    bound = result["bound_ms"]
    print(f"read bandwidth {result['bandwidth'] / 1e9:.1f} GB/s ({args.threads} threads); "
          f"weights {result['weight_bytes'] / 1e6:.0f} MB -> decode step bound {bound:.1f} ms")
    for mode in modes:
        for batch, ms in result["decode_ms"][mode].items():
            print(f"{mode:8s} decode batch {batch:3d}: {ms:7.1f} ms  ({ms / bound:.2f}x the bound)")
        print(f"{mode:8s} prefill 512 tokens: {result['prefill_ms'][mode]:.1f} ms")


if __name__ == "__main__":
    main()
