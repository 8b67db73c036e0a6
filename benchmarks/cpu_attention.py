"""CPU paged attention: `kernels.torch_attention` (the engine's CPU path) vs the plain oracle
(tests/kernels/attention_oracle.py).

    .venv/bin/python benchmarks/cpu_attention.py [--threads 2] [--layers 12]

Heads of the 100M Llama of benchmarks/throughput.py (12 query / 4 KV heads, head_dim 64),
block 16, fp32. Per-layer timings (median of 5 after a warm-up):

- decode: 32 sequences, ragged contexts 128–1024 tokens, block tables consecutive (a fresh
  pool allocates runs) and scattered (a churned pool: a random permutation);
- prefill: 512 new tokens with no cached prefix, and 512 new tokens after 512 cached ones.

Both implementations are checked equal first (max |diff| printed). The "step" rows multiply
by --layers: attention time of one forward of the whole model. Prints a Markdown table with
the speed-up (oracle time / torch_attention time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdcluster.kernels import torch_attention  # noqa: E402
from tests.kernels import attention_oracle  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16


def median_s(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def block_tables(seq_lens: list[int], num_blocks: int, scattered: bool) -> torch.Tensor:
    order = torch.randperm(num_blocks) if scattered else torch.arange(num_blocks)
    needed = [-(-n // BLOCK) for n in seq_lens]
    table = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    start = 0
    for row, n in enumerate(needed):
        table[row, :n] = order[start:start + n]
        start += n
    return table


def cases(num_blocks: int):
    """(name, function name, its inputs but the caches and scale) for every measured shape."""
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(128, 1025, (32,), generator=gen).tolist()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(32, HEADS, HEAD_DIM, generator=gen)
    for scattered in (False, True):
        name = f"decode, 32 seqs, ctx 128–1024, {'scattered' if scattered else 'consecutive'}"
        yield name, "paged_decode_attention", (q, block_tables(seq_lens, num_blocks, scattered),
                                              lens)
    for cached in (0, 512):
        total = cached + 512
        cu = torch.tensor([0, 512], dtype=torch.int32)
        yield (f"prefill, 512 new after {cached} cached", "paged_prefill_attention",
               (torch.randn(512, HEADS, HEAD_DIM, generator=gen),
                block_tables([total], num_blocks, True), cu,
                torch.tensor([total], dtype=torch.int32)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    num_blocks = 32 * 1024 // BLOCK + 64
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    scale = HEAD_DIM ** -0.5
    print(f"torch {torch.__version__}, {args.threads} threads, fp32\n")
    print("| case | oracle ms/layer | torch_attention ms/layer | speed-up | "
          f"attention per step ({args.layers} layers), ms | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, fn, inputs in cases(num_blocks):
        q, *rest = inputs
        call = [(impl, lambda impl=impl: getattr(impl, fn)(q, k_cache, v_cache, *rest, scale))
                for impl in (attention_oracle, torch_attention)]
        diff = (call[0][1]() - call[1][1]()).abs().max().item()
        ref_s, fast_s = (median_s(c) for _, c in call)
        print(f"| {name} | {ref_s * 1e3:.2f} | {fast_s * 1e3:.2f} | {ref_s / fast_s:.1f}× | "
              f"{ref_s * args.layers * 1e3:.0f} → {fast_s * args.layers * 1e3:.0f} | "
              f"{diff:.1e} |")


if __name__ == "__main__":
    main()
