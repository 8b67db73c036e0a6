"""Triton kernel throughput against the device's own ceilings and against SDPA.

    .venv/bin/python benchmarks/gpu_kernels.py            # on a CUDA GPU: the real shapes
    .venv/bin/python benchmarks/gpu_kernels.py --smoke    # anywhere: tiny shapes (interpreted on CPU)
    .venv/bin/python benchmarks/gpu_kernels.py --sweep-prefill   # the prefill kernel's tile configs

On a CUDA GPU every kernel runs through its public `kernels.*` function with the backend forced to
Triton and is timed with `triton.testing.do_bench` (median of its repetitions). A call whose kernel
runs for tens of microseconds is then timed partly by the host's Python launch path, which a
decode step under CUDA graphs never pays: `--cuda-graph` times replays of a captured graph of each
call instead (`triton.testing.do_bench_cudagraph`). Next to each time:
GB/s with bytes = bytes read + bytes written once (each input read once, each output written
once; split-K workspace traffic not counted), or TFLOP/s with 2 FLOPs per multiply-add, QK^T and
PV both counted, causal attention halved. Ceilings measured in the same run: a device-to-device
copy (`copy_` of 1 GiB; bytes = read + written) and an 8192^3 bf16 matmul. Baseline:
`torch.nn.functional.scaled_dot_product_attention` on contiguous K/V of the same shapes.

Shapes (bf16): decode: batch 64, context 4096, 32 query / 8 KV heads, head_dim 128, block 16;
prefill: 8 sequences x 2048 new tokens (no cached prefix), causal, same heads; elementwise:
rms_norm (with residual) on 16384 x 8192, silu_and_mul 16384 x 2*8192 -> 16384 x 8192,
rotary and store_kv_cache on 16384 tokens of the decode heads.
Targets on an H200: decode >= 75% of copy bandwidth and faster than SDPA; prefill >= 40% of the
matmul rate; elementwise >= 70% of copy bandwidth.

Without a GPU (or with --smoke) the same code runs on tiny shapes, on CPU in Triton's
interpreter, timed with a wall clock and checked against the torch references: the numbers mean
nothing, the run keeps the script from rotting. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import product

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402

from pdcluster import kernels  # noqa: E402
from pdcluster.kernels import reference, triton_paged_prefill  # noqa: E402
from tests.kernels import attention_oracle  # noqa: E402

GB, TFLOP = 1e9, 1e12


@dataclass(frozen=True)
class Shapes:
    batch: int = 64
    context: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    prefill_seqs: int = 8
    prefill_len: int = 2048
    rows: int = 16384
    width: int = 8192
    copy_bytes: int = 1 << 30
    matmul: int = 8192
    dtype: torch.dtype = torch.bfloat16


SMOKE = Shapes(batch=2, context=40, num_heads=4, num_kv_heads=2, head_dim=16, prefill_seqs=2, prefill_len=24,
               rows=8, width=64, copy_bytes=1 << 16, matmul=64, dtype=torch.float32)


@dataclass
class Row:
    name: str
    ms: float
    amount: float  # bytes or FLOPs
    unit: str  # "GB/s" or "TFLOP/s"
    accounting: str

    @property
    def rate(self) -> float:
        return self.amount / (self.ms * 1e-3) / (GB if self.unit == "GB/s" else TFLOP)


def _timer(smoke: bool, cuda_graph: bool = False) -> Callable[[Callable[[], object]], float]:
    if not smoke and cuda_graph:
        return lambda fn: triton.testing.do_bench_cudagraph(fn, return_mode="median")
    if not smoke:
        return lambda fn: triton.testing.do_bench(fn, return_mode="median")

    def wall_ms(fn: Callable[[], object]) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall_ms


def _check(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not torch.allclose(got.float(), expected.float(), atol=1e-3, rtol=1e-3):
        raise SystemExit(f"{what}: Triton result differs from the torch reference")


def _paged_decode_inputs(s: Shapes, device: torch.device):
    blocks_per_seq = -(-s.context // s.block_size)
    num_blocks = s.batch * blocks_per_seq
    cache_shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    k_cache = torch.randn(cache_shape, dtype=s.dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=s.dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(s.batch, blocks_per_seq)
    seq_lens = torch.full((s.batch,), s.context, dtype=torch.int32, device=device)
    q = torch.randn(s.batch, s.num_heads, s.head_dim, dtype=s.dtype, device=device)
    return q, k_cache, v_cache, block_tables, seq_lens


def _contiguous_kv(k_cache, block_tables, s: Shapes, num_seqs: int, length: int) -> torch.Tensor:
    """[num_seqs, num_kv_heads, length, head_dim]: the same K (or V) gathered contiguous."""
    gathered = k_cache[block_tables.long()].reshape(num_seqs, -1, s.num_kv_heads, s.head_dim)[:, :length]
    return gathered.transpose(1, 2).contiguous()


def _prefill_inputs(s: Shapes, device: torch.device):
    """q, caches, block tables, cu_seqlens_q, seq_lens of the prefill shape, and its causal FLOPs."""
    n, seqs = s.prefill_len, s.prefill_seqs
    blocks_per_seq = -(-n // s.block_size)
    cache_shape = (seqs * blocks_per_seq, s.block_size, s.num_kv_heads, s.head_dim)
    k_cache = torch.randn(cache_shape, dtype=s.dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=s.dtype, device=device)
    block_tables = torch.randperm(seqs * blocks_per_seq, device=device).to(torch.int32).view(seqs, blocks_per_seq)
    q = torch.randn(seqs * n, s.num_heads, s.head_dim, dtype=s.dtype, device=device)
    cu = torch.arange(0, seqs * n + 1, n, dtype=torch.int32, device=device)
    lens = torch.full((seqs,), n, dtype=torch.int32, device=device)
    flops = 4 * seqs * s.num_heads * n * n * s.head_dim / 2
    return q, k_cache, v_cache, block_tables, cu, lens, flops


def bench_attention(s: Shapes, device: torch.device, time_ms, smoke: bool) -> list[Row]:
    item = torch.empty((), dtype=s.dtype).element_size()
    scale = s.head_dim**-0.5
    rows = []
    # decode
    q, k_cache, v_cache, block_tables, seq_lens = _paged_decode_inputs(s, device)
    kv_bytes = 2 * s.batch * s.context * s.num_kv_heads * s.head_dim * item
    q_out_bytes = 2 * s.batch * s.num_heads * s.head_dim * item
    meta_bytes = block_tables.numel() * 4 + seq_lens.numel() * 4
    decode = lambda: kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)  # noqa: E731
    if smoke:
        expected = attention_oracle.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
        _check(decode(), expected, "decode")
    accounting = "K+V read + q read + out written + block tables"
    rows.append(Row("paged_decode_attention", time_ms(decode), kv_bytes + q_out_bytes + meta_bytes, "GB/s", accounting))
    k = _contiguous_kv(k_cache, block_tables, s, s.batch, s.context)
    v = _contiguous_kv(v_cache, block_tables, s, s.batch, s.context)
    q4 = q.unsqueeze(2)  # [batch, heads, 1, head_dim]
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q4, k, v, scale=scale, enable_gqa=True
    )
    rows.append(Row("SDPA decode, contiguous K/V", time_ms(sdpa), kv_bytes + q_out_bytes, "GB/s",
                    "K+V read + q read + out written"))
    # prefill
    q, k_cache, v_cache, block_tables, cu, lens, flops = _prefill_inputs(s, device)
    seqs, n = s.prefill_seqs, s.prefill_len
    prefill = lambda: kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, lens, scale)  # noqa: E731
    if smoke:
        _check(prefill(), attention_oracle.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, lens, scale),
               "prefill")
    accounting = "4*seqs*heads*len^2*head_dim, halved (causal)"
    rows.append(Row("paged_prefill_attention", time_ms(prefill), flops, "TFLOP/s", accounting))
    k = _contiguous_kv(k_cache, block_tables, s, seqs, n)
    v = _contiguous_kv(v_cache, block_tables, s, seqs, n)
    q4 = q.view(seqs, n, s.num_heads, s.head_dim).transpose(1, 2).contiguous()
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q4, k, v, scale=scale, is_causal=True, enable_gqa=True
    )
    rows.append(Row("SDPA prefill, contiguous K/V", time_ms(sdpa), flops, "TFLOP/s", accounting))
    return rows


#: tile configs the prefill sweep tries: BLOCK_M, BLOCK_N, num_warps, num_stages
SWEEP = {"block_m": (64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
SMOKE_SWEEP = {"block_m": (16,), "block_n": (16, 32), "num_warps": (4,), "num_stages": (1,)}


def sweep_prefill(s: Shapes, device: torch.device, time_ms, smoke: bool, matmul_rate: float,
                  deadline: float) -> None:
    """Time paged_prefill_attention at every tile config of SWEEP (head_dim s.head_dim, then 64)
    and print one Markdown row each, checked against SDPA on the same K/V gathered contiguous
    (a row past the dtype's tolerance is marked WRONG).
    The launch's warps and stages are set here, not through the launcher's API: they are the
    knobs under test. Stops at `deadline` (time.monotonic)."""
    grid = SMOKE_SWEEP if smoke else SWEEP
    # a 16-bit output is rounded once: its ulp at the outputs' magnitude (|out| < 1 here)
    tolerance = 1e-3 if s.dtype == torch.float32 else 2e-2
    print("\n| head_dim | BLOCK_M | BLOCK_N | warps | stages | ms | TFLOP/s | of matmul | max abs err |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for head_dim in dict.fromkeys((s.head_dim, min(s.head_dim, 64))):
        shape = replace(s, head_dim=head_dim)
        scale = head_dim**-0.5
        q, k_cache, v_cache, block_tables, cu, lens, flops = _prefill_inputs(shape, device)
        seqs, n = shape.prefill_seqs, shape.prefill_len
        k = _contiguous_kv(k_cache, block_tables, shape, seqs, n)
        v = _contiguous_kv(v_cache, block_tables, shape, seqs, n)
        q4 = q.view(seqs, n, shape.num_heads, head_dim).transpose(1, 2)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q4, k, v, scale=scale, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(q.shape)
        for block_m, block_n, warps, stages in product(*grid.values()):
            if time.monotonic() > deadline:
                print("(sweep stopped at its deadline)")
                return
            launches, out = triton_paged_prefill.plan_paged_prefill_attention(
                q, k_cache, v_cache, block_tables, cu, lens, scale, block_m=block_m, block_n=block_n)
            launches = [replace(launch, num_warps=warps, num_stages=stages) for launch in launches]
            cells = f"| {head_dim} | {block_m} | {block_n} | {warps} | {stages} |"
            try:
                ms = time_ms(lambda: [launch.run() for launch in launches])  # noqa: B023
            except Exception as exc:  # noqa: BLE001 - a config the chip cannot hold is a row too
                print(f"{cells} failed: {type(exc).__name__} |||")
                continue
            err = (out.float() - expected.float()).abs().max().item()
            wrong = "" if err <= tolerance else " WRONG"
            print(f"{cells} {ms:.4f} | {flops / (ms * 1e-3) / TFLOP:.0f} | "
                  f"{flops / (ms * 1e-3) / TFLOP / matmul_rate:.0%} | {err:.3g}{wrong} |")


def bench_elementwise(s: Shapes, device: torch.device, time_ms, smoke: bool) -> list[Row]:
    item = torch.empty((), dtype=s.dtype).element_size()
    rows = []
    x = torch.randn(s.rows, s.width, dtype=s.dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(s.width, dtype=s.dtype, device=device)
    norm = lambda: kernels.rms_norm(x, weight, 1e-5, residual)  # noqa: E731
    if smoke:
        _check(norm()[0], reference.rms_norm(x, weight, 1e-5, residual)[0], "rms_norm")
    rows.append(Row("rms_norm (+residual)", time_ms(norm), (4 * x.numel() + s.width) * item, "GB/s",
                    "x, residual, weight read; out, new_residual written"))
    gate_up = torch.randn(s.rows, 2 * s.width, dtype=s.dtype, device=device)
    act = lambda: kernels.silu_and_mul(gate_up)  # noqa: E731
    if smoke:
        _check(act(), reference.silu_and_mul(gate_up), "silu_and_mul")
    rows.append(Row("silu_and_mul", time_ms(act), 3 * s.rows * s.width * item, "GB/s",
                    "[rows, 2w] read, [rows, w] written"))
    q = torch.randn(s.rows, s.num_heads, s.head_dim, dtype=s.dtype, device=device)
    k = torch.randn(s.rows, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device)
    positions = torch.randint(0, 8192, (s.rows,), device=device)
    cos_sin = torch.randn(8192, s.head_dim, dtype=torch.float32, device=device)
    rope = lambda: kernels.rotary_embedding(positions, q, k, cos_sin)  # noqa: E731
    if smoke:
        expected = reference.rotary_embedding(positions, q.clone(), k.clone(), cos_sin)
        _check(kernels.rotary_embedding(positions, q.clone(), k.clone(), cos_sin)[0], expected[0], "rotary")
    qk_bytes = (q.numel() + k.numel()) * item
    rows.append(Row("rotary_embedding (in place)", time_ms(rope), 2 * qk_bytes + s.rows * (8 + s.head_dim * 4),
                    "GB/s", "q, k read + written; positions, cos|sin rows read"))
    blocks = -(-s.rows // s.block_size)
    k_cache = torch.empty(blocks, s.block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(blocks * s.block_size, device=device)[: s.rows]
    store = lambda: kernels.store_kv_cache(k, k, k_cache, v_cache, slots)  # noqa: E731
    rows.append(Row("store_kv_cache", time_ms(store), 4 * k.numel() * item + s.rows * 8, "GB/s",
                    "k, v read; k_cache, v_cache rows written; slots read"))
    return rows


def bench_ceilings(s: Shapes, device: torch.device, time_ms) -> list[Row]:
    src = torch.empty(s.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rows = [Row("ceiling: device copy", time_ms(lambda: dst.copy_(src)), 2 * s.copy_bytes, "GB/s", "read + written")]
    a = torch.randn(s.matmul, s.matmul, dtype=s.dtype, device=device)
    b = torch.randn_like(a)
    rows.append(Row(f"ceiling: {s.matmul}^3 matmul", time_ms(lambda: a @ b), 2 * s.matmul**3, "TFLOP/s", "2*n^3"))
    return rows


def _verdicts(rows: dict[str, Row]) -> list[str]:
    copy, matmul = rows["ceiling: device copy"].rate, next(r for n, r in rows.items() if "matmul" in n).rate
    decode = rows["paged_decode_attention"]
    lines = [
        f"- decode: {decode.rate / copy:.0%} of copy bandwidth (target >= 75%); "
        f"{rows['SDPA decode, contiguous K/V'].ms / decode.ms:.2f}x SDPA's speed (target > 1)",
        f"- prefill: {rows['paged_prefill_attention'].rate / matmul:.0%} of the matmul rate (target >= 40%); "
        f"{rows['SDPA prefill, contiguous K/V'].ms / rows['paged_prefill_attention'].ms:.2f}x SDPA's speed",
    ]
    for name in ("rms_norm (+residual)", "silu_and_mul", "rotary_embedding (in place)", "store_kv_cache"):
        lines.append(f"- {name}: {rows[name].rate / copy:.0%} of copy bandwidth (target >= 70%)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (always so without CUDA)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time replays of a captured CUDA graph of each call: the kernels' device "
                             "time without the host's launch cost between calls")
    parser.add_argument("--sweep-prefill", action="store_true",
                        help="only time paged_prefill_attention's tile configs (BLOCK_M, BLOCK_N, warps, "
                             "stages) at head_dim 128 and 64")
    parser.add_argument("--sweep-seconds", type=float, default=240.0, help="stop the sweep after this long")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    smoke = args.smoke or not on_gpu
    device = torch.device("cuda" if on_gpu else "cpu")
    shapes = SMOKE if smoke else Shapes()
    kernels.set_backend("triton")
    torch.manual_seed(0)
    time_ms = _timer(smoke or not on_gpu, args.cuda_graph)
    cpu_name = f"{platform.processor() or 'CPU'} (Triton interpreter)"
    name = torch.cuda.get_device_name(device) if on_gpu else cpu_name
    print(f"device: {name}; torch {torch.__version__}, triton {triton.__version__}; dtype {shapes.dtype}")
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    rows = bench_ceilings(shapes, device, time_ms)
    if args.sweep_prefill:
        print(f"ceiling: {rows[1].rate:.0f} TFLOP/s ({rows[1].name})")
        sweep_prefill(shapes, device, time_ms, smoke, rows[1].rate, time.monotonic() + args.sweep_seconds)
        return
    rows += bench_attention(shapes, device, time_ms, smoke)
    rows += bench_elementwise(shapes, device, time_ms, smoke)
    if smoke:
        print("SMOKE RUN: tiny shapes, wall-clock timing; the numbers are meaningless (results checked vs reference)")
    print("\n| kernel | time (ms, median) | rate | accounting |\n|---|---:|---:|---|")
    for row in rows:
        print(f"| {row.name} | {row.ms:.4f} | {row.rate:.3g} {row.unit} | {row.accounting} |")
    print()
    for line in _verdicts({row.name: row for row in rows}):
        print(line)


if __name__ == "__main__":
    main()
