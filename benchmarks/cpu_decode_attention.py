"""The C++ CPU decode attention kernel (kernels.cpu_paged_attention) against the read bandwidth
measured in the same run.

    .venv/bin/python benchmarks/cpu_decode_attention.py [--threads 2] [--batch 32]
                                                        [--context 600] [--repeats 30]

Heads of the 100M Llama of benchmarks/throughput.py (12 query / 4 KV heads, head_dim 64),
block 16, every sequence `--context` tokens long over scattered blocks: one layer of a decode
step at `--batch`, as `benchmarks/step_time.py` runs it. For float32 and bfloat16 it prints the
median time per layer (after a warm-up), the K/V bytes read over that time, and the same call
with every sequence reading the same blocks (cache-resident: what is left when memory is not
the limit). The bandwidth is a float32 sum over 1 GiB at the same thread count, bytes read per
second, measured before each dtype's rows because this VM's bandwidth moves from minute to
minute. The kernel is checked against the attention oracle first (max |diff| printed).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdcluster.kernels import cpu_paged_attention  # noqa: E402
from tests.kernels import attention_oracle  # noqa: E402

from step_time import median_ms, read_bandwidth  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16
CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not cpu_paged_attention.supports(torch.empty(1, 1, HEAD_DIM),
                                        torch.empty(1, BLOCK, 1, HEAD_DIM)):
        raise SystemExit("the C++ CPU kernels cannot be built here")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-args.context // BLOCK)
    num_blocks = args.batch * blocks_per_seq
    scattered = torch.randperm(num_blocks, generator=gen).view(args.batch, blocks_per_seq)
    tables = {"scattered": scattered.to(torch.int32),
              "cache-resident": scattered[:1].expand(args.batch, -1).contiguous().to(torch.int32)}
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    scale = HEAD_DIM ** -0.5
    print(f"torch {torch.__version__}, {args.threads} threads; batch {args.batch}, context "
          f"{args.context}, {HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}, block {BLOCK}\n")
    print("| dtype | blocks | ms/layer | K/V read | read bandwidth (sum) | max abs diff |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
        q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
        kv_bytes = 2 * args.batch * args.context * KV_HEADS * HEAD_DIM * k_cache.element_size()
        bandwidth = read_bandwidth()
        for name, table in tables.items():
            def call(table=table):
                return cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, table,
                                                                  lens, scale)
            want = attention_oracle.paged_decode_attention(q.float(), k_cache.float(),
                                                           v_cache.float(), table, lens, scale)
            diff = (call().float() - want).abs().max().item()
            ms = median_ms(call, args.repeats, CPU)
            print(f"| {str(dtype).removeprefix('torch.')} | {name} | {ms:.3f} | "
                  f"{kv_bytes / ms / 1e6:.1f} GB/s | {bandwidth / 1e9:.1f} GB/s | {diff:.1e} |")


if __name__ == "__main__":
    main()
