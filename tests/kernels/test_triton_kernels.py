"""Triton kernels vs their torch references (STYLE item 9), on fresh random inputs.

Where the matrix runs: on a CUDA device when there is one (marked `gpu`; bf16 included), else
in Triton's interpreter. The interpreter is chosen by TRITON_INTERPRET=1 when the kernels are
first imported, which a pytest session that already imported them cannot change, so without
CUDA `test_interpreter_matrix` re-runs this file in a child pytest with the variable set
(fp32 and fp16: the interpreter's bf16 dots are wrong). Outputs are poisoned with NaN first, so
an element a kernel fails to write fails the comparison; unreferenced cache storage holds a
large finite value, so a key the kernel should not see skews the result.

Matrix: GQA 1, 2, 4, 8; head_dim 8 (padded to 16 in the kernels), 64, 128; block_size 16, 32;
ragged lengths including 1 and exact block boundaries; split-K decode with 1 and 3 splits.
Input checks (KernelInputError) and dispatch run in every process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from tests.real_parts import import_real_part

import_real_part("triton", "Triton", "scripts/setup.sh installs it on Linux")

from pdcluster import kernels  # noqa: E402
from pdcluster.kernels import reference, torch_attention  # noqa: E402
from pdcluster.kernels._triton_common import KernelInputError  # noqa: E402
from pdcluster.kernels.triton_activation import plan_silu_and_mul  # noqa: E402
from pdcluster.kernels.triton_fused_moe import align_block_size, fused_moe  # noqa: E402
from pdcluster.kernels.triton_mla_decode import paged_mla_decode  # noqa: E402
from pdcluster.kernels.triton_kv_cache import plan_store_kv_cache  # noqa: E402
from pdcluster.kernels.triton_paged_decode import choose_num_splits, plan_paged_decode_attention  # noqa: E402
from pdcluster.kernels.triton_paged_prefill import plan_paged_prefill_attention  # noqa: E402
from pdcluster.kernels.triton_rms_norm import plan_rms_norm  # noqa: E402
from pdcluster.kernels.triton_rotary import plan_rotary_embedding  # noqa: E402
from tests.kernels import attention_oracle  # noqa: E402
from tests.kernels.routing import skewed_routing  # noqa: E402

ON_CUDA = torch.cuda.is_available()
INTERPRETED = kernels.triton_interpreted()
RUNS_HERE = ON_CUDA or INTERPRETED
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
SEED = int(os.environ.get("PDCLUSTER_KERNEL_SEED") or zlib.crc32(os.urandom(8)))

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
# (atol, rtol): fp32 dots run in IEEE precision; half types round P to the input dtype for P @ V.
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
# (GQA group, head_dim, block_size): each value of each axis at least once, each group once.
ATTENTION_CONFIGS = [(1, 64, 16), (2, 8, 32), (4, 128, 16), (8, 8, 16), (2, 128, 32), (4, 64, 32)]
GARBAGE = 1.0e4  # cache storage no sequence owns


def matrix(test):
    """A matrix test: marked `gpu` and `kernel_matrix`; runs on CUDA or in the interpreter.
    Without either, conftest deselects it here and test_interpreter_matrix runs it in a child."""
    return pytest.mark.kernel_matrix(pytest.mark.gpu(test))


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + zlib.crc32(repr(key).encode()))


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _poison(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def _close(got: torch.Tensor, expected: torch.Tensor, what: str, equal_nan: bool = False) -> None:
    atol, rtol = TOLERANCE[expected.dtype] if expected.dtype in TOLERANCE else (0.0, 0.0)
    torch.testing.assert_close(
        got, expected, atol=atol, rtol=rtol, equal_nan=equal_nan,
        msg=lambda m: f"{what} (PDCLUSTER_KERNEL_SEED={SEED}): {m}",
    )


def _run(launches) -> None:
    for launch in launches:
        launch.run()


def _paged_cache(gen, seq_lens, block_size, num_kv_heads, head_dim, dtype):
    """Caches holding each sequence's random K/V in shuffled blocks, GARBAGE everywhere else.

    Returns (k_cache, v_cache, block_tables int32 [num_seqs, max_blocks + 1] padded with 0,
    per-sequence block lists)."""
    counts = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(counts) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, GARBAGE, dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, GARBAGE, dtype=dtype, device=DEVICE)
    block_tables = torch.zeros(len(seq_lens), max(counts, default=0) + 1, dtype=torch.int32)
    start = 0
    for row, (seq_len, count) in enumerate(zip(seq_lens, counts)):
        table = order[start : start + count]
        start += count
        block_tables[row, :count] = torch.tensor(table, dtype=torch.int32)
        positions = torch.arange(seq_len)
        slots = torch.tensor(table, dtype=torch.int64)[positions // block_size] * block_size + positions % block_size
        k, v = (_randn(gen, seq_len, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))
        reference.store_kv_cache(k, v, k_cache, v_cache, slots.to(DEVICE))
    return k_cache, v_cache, block_tables.to(DEVICE)


def _heads(group: int) -> tuple[int, int]:
    num_kv_heads = 1 if group == 8 else 2
    return group * num_kv_heads, num_kv_heads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,head_dim,block_size", ATTENTION_CONFIGS)
@matrix
def test_paged_decode_attention(group, head_dim, block_size, dtype):
    gen = _gen("decode", group, head_dim, block_size, dtype)
    num_heads, num_kv_heads = _heads(group)
    # the longest context spans 9 blocks, past 3 tiles of every tile config, so 3 splits stay 3
    seq_lens = [1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 5, 8 * block_size + 3]
    k_cache, v_cache, block_tables = _paged_cache(gen, seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = _randn(gen, len(seq_lens), num_heads, head_dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = attention_oracle.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale)
    # 8 splits: each sequence cuts its own length into them, so the short ones leave some empty
    for num_splits in (1, 3, 8):
        launches, out = plan_paged_decode_attention(
            q, k_cache, v_cache, block_tables, lens, scale, out=_poison(q), num_splits=num_splits
        )
        assert len(launches) == (1 if num_splits == 1 else 2)
        _run(launches)
        _close(out, expected, f"decode, {num_splits} splits")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [13, 40])
@matrix
def test_paged_attention_sliding_window(window, dtype):
    """Both kernels against the oracle's window mask: decode with 1 and 3 splits, and prefill
    chunks whose first query's window starts inside a key tile and past the first."""
    group, head_dim, block_size = 2, 64, 16
    gen = _gen("window", window, dtype)
    num_heads, num_kv_heads = _heads(group)
    seq_lens = [1, 14, 40, 8 * block_size + 3]
    k_cache, v_cache, block_tables = _paged_cache(gen, seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = _randn(gen, len(seq_lens), num_heads, head_dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = attention_oracle.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale, window)
    for num_splits in (1, 3):
        launches, out = plan_paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale,
                                                    out=_poison(q), num_splits=num_splits,
                                                    sliding_window=window)
        _run(launches)
        _close(out, expected, f"windowed decode, {num_splits} splits")
    shapes = [(0, 1), (0, 14), (17, 23), (3 * block_size + 1, 5 * block_size)]
    args = _prefill_case(gen, group, head_dim, block_size, dtype, shapes, padding_rows=2)
    expected = attention_oracle.paged_prefill_attention(*args, sliding_window=window)
    launches, out = plan_paged_prefill_attention(*args, out=_poison(args[0]), sliding_window=window)
    _run(launches)
    _close(out, expected, "windowed prefill")


def _prefill_case(gen, group, head_dim, block_size, dtype, shapes, padding_rows):
    """shapes: (cached prefix, new tokens) per sequence -> inputs of paged_prefill_attention."""
    num_heads, num_kv_heads = _heads(group)
    seq_lens = [p + n for p, n in shapes]
    k_cache, v_cache, block_tables = _paged_cache(gen, seq_lens, block_size, num_kv_heads, head_dim, dtype)
    cu = [0]
    for _, num_new in shapes:
        cu.append(cu[-1] + num_new)
    q = _randn(gen, cu[-1] + padding_rows, num_heads, head_dim, dtype=dtype)
    cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, head_dim**-0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,head_dim,block_size", ATTENTION_CONFIGS)
@matrix
def test_paged_prefill_attention(group, head_dim, block_size, dtype):
    gen = _gen("prefill", group, head_dim, block_size, dtype)
    # A one-token prompt, an exact-block prompt, a chunk after a full block, a decode-like row,
    # a chunk after a ragged prefix crossing tiles (first position one short of a key tile's
    # end: the last unmasked tile boundary), and a sequence with no new tokens.
    shapes = [(0, 1), (0, block_size), (block_size, block_size + 3), (3, 1), (2 * block_size - 2, 19), (5, 0)]
    args = _prefill_case(gen, group, head_dim, block_size, dtype, shapes, padding_rows=3)
    expected = attention_oracle.paged_prefill_attention(*args)
    launches, out = plan_paged_prefill_attention(*args, out=_poison(args[0]))
    _run(launches)
    _close(out, expected, "prefill")
    assert torch.all(out[-3:] == 0), "rows past cu_seqlens_q[-1] must be zero"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@matrix
def test_paged_prefill_attention_gpu_tiles(dtype):
    """The GPU tile config (BLOCK_M 128 / BLOCK_N 64 for half types) on a long chunk."""
    gen = _gen("prefill-gpu-tiles", dtype)
    shapes = [(62, 150), (0, 3), (17, 64)]  # 62: one short of a 32- and a 64-key tile boundary
    args = _prefill_case(gen, 4, 128, 16, dtype, shapes, padding_rows=5)
    expected = attention_oracle.paged_prefill_attention(*args)
    launches, out = plan_paged_prefill_attention(*args, out=_poison(args[0]), target="gpu")
    _run(launches)
    _close(out, expected, "prefill, GPU tiles")
    assert torch.all(out[-5:] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(4, 8, 16), (2, 64, 32), (8, 128, 16)])
@matrix
def test_store_kv_cache(num_kv_heads, head_dim, block_size, dtype):
    gen = _gen("store", num_kv_heads, head_dim, block_size, dtype)
    num_blocks = 5
    k, v = (_randn(gen, 9, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))
    last = num_blocks * block_size - 1
    slots = [0, -1, block_size - 1, block_size, 2 * block_size + 3, -1, last, 3 * block_size, 1]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(k, v, expected_k, expected_v, slot_mapping)
    _run(plan_store_kv_cache(k, v, k_cache, v_cache, slot_mapping.to(torch.int32)))
    assert torch.equal(k_cache.isnan(), expected_k.isnan()) and torch.equal(v_cache.isnan(), expected_v.isnan())
    _close(k_cache, expected_k, "k_cache", equal_nan=True)
    _close(v_cache, expected_v, "v_cache", equal_nan=True)
    written = (slot_mapping >= 0).sum().item() * num_kv_heads * head_dim
    assert (~k_cache.isnan()).sum().item() == written, "slot -1 must be skipped"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@matrix
def test_kernels_over_a_cross_layer_caches_views(dtype):
    """One layer's K and V of a cross-layer cache (engine.kv_cache: views whose blocks sit
    num_layers * 2 blocks apart): the store writes that layer's slots only, and decode and
    prefill over the views match the oracle."""
    from pdcluster.engine.kv_cache import PagedKVCache

    gen = _gen("cross-layer", dtype)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    seq_lens = [1, block_size + 1, 3 * block_size - 5]
    counts = [-(-n // block_size) for n in seq_lens]
    cache = PagedKVCache.attention(3, sum(counts) + 3, block_size, num_kv_heads, head_dim, dtype, DEVICE,
                         layout="cross-layer")
    # [num_blocks, layers, K|V, block_size, kv_heads, head_dim]: the one-group spec's bytes
    blocks = cache.blocks.view(dtype).view(cache.num_blocks, 3, 2, block_size, num_kv_heads,
                                           head_dim)
    blocks.fill_(GARBAGE)
    k_cache, v_cache = cache.k[1], cache.v[1]
    order = torch.randperm(cache.num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32)
    slots, start = [], 0
    for row, (seq_len, count) in enumerate(zip(seq_lens, counts)):
        table = order[start:start + count]
        start += count
        tables[row, :count] = torch.tensor(table, dtype=torch.int32)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    k, v = (_randn(gen, len(slots), num_kv_heads, head_dim, dtype=dtype) for _ in range(2))
    _run(plan_store_kv_cache(k, v, k_cache, v_cache, slot_mapping))
    expected_k, expected_v = (torch.full_like(c, GARBAGE).contiguous() for c in (k_cache, v_cache))
    reference.store_kv_cache(k, v, expected_k, expected_v, slot_mapping)
    _close(k_cache, expected_k, "k_cache")
    _close(v_cache, expected_v, "v_cache")
    assert bool((blocks[:, [0, 2]] == GARBAGE).all()), "other layers must stay untouched"
    tables, lens = tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    q = _randn(gen, len(seq_lens), num_heads, head_dim, dtype=dtype)
    launches, out = plan_paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                                out=_poison(q), num_splits=3)
    _run(launches)
    _close(out, attention_oracle.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale),
           "decode over cross-layer views")
    new = [1, 5, 3 * block_size - 5]
    cu = torch.tensor([0, 1, 6, 6 + new[2]], dtype=torch.int32, device=DEVICE)
    q = _randn(gen, sum(new), num_heads, head_dim, dtype=dtype)
    args = (q, k_cache, v_cache, tables, cu, lens, scale)
    launches, out = plan_paged_prefill_attention(*args, out=_poison(q))
    _run(launches)
    _close(out, attention_oracle.paged_prefill_attention(*args), "prefill over cross-layer views")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 3, 256)], ids=str)
@matrix
def test_rms_norm(shape, dtype):
    gen = _gen("rms_norm", shape, dtype)
    x, residual = _randn(gen, *shape, dtype=dtype), _randn(gen, *shape, dtype=dtype)
    weight = _randn(gen, shape[-1], dtype=dtype)
    expected, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    launches, out, new_residual = plan_rms_norm(
        x, weight, 1e-5, residual, out=_poison(x), new_residual=_poison(x)
    )
    _run(launches)
    _close(out, expected, "rms_norm out")
    _close(new_residual, expected_residual, "rms_norm new_residual")
    expected, _ = reference.rms_norm(x, weight, 1e-5)
    launches, out, passthrough = plan_rms_norm(x, weight, 1e-5, out=_poison(x))
    _run(launches)
    assert passthrough is x
    _close(out, expected, "rms_norm without residual")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 2 * 172), (2, 4, 2 * 64), (2, 2 * 1500)], ids=str)
@matrix
def test_silu_and_mul(shape, dtype):
    x = _randn(_gen("silu", shape, dtype), *shape, dtype=dtype) * 3
    launches, out = plan_silu_and_mul(x, out=torch.full((*shape[:-1], shape[-1] // 2), float("nan"), dtype=dtype,
                                                        device=DEVICE))
    _run(launches)
    _close(out, reference.silu_and_mul(x), "silu_and_mul")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 4, 8), (2, 2, 64), (32, 8, 128)])
@matrix
def test_rotary_embedding(num_heads, num_kv_heads, head_dim, dtype):
    from pdcluster.engine.rope import compute_inv_freq, rope_cos_sin_cache

    gen = _gen("rotary", num_heads, num_kv_heads, head_dim, dtype)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cos_sin_cache = rope_cos_sin_cache(compute_inv_freq(head_dim, 10000.0, scaling), 512).to(DEVICE)
    positions = torch.randint(1, 512, (11,), generator=gen).to(DEVICE)  # not 0: that rotation is the identity
    q, k = _randn(gen, 11, num_heads, head_dim, dtype=dtype), _randn(gen, 11, num_kv_heads, head_dim, dtype=dtype)
    expected_q, expected_k = reference.rotary_embedding(positions, q.clone(), k.clone(), cos_sin_cache)
    _run(plan_rotary_embedding(positions, q, k, cos_sin_cache))
    _close(q, expected_q, "rotary q")
    _close(k, expected_k, "rotary k")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter",
                         [(1, 4, 2, 64, 48), (37, 8, 2, 64, 48), (70, 4, 1, 32, 96)])
@matrix
def test_fused_moe(num_tokens, num_experts, top_k, hidden, inter, dtype):
    gen = _gen("moe", num_tokens, num_experts, top_k, dtype)
    x = _randn(gen, num_tokens, hidden, dtype=dtype)
    w13 = _randn(gen, num_experts, 2 * inter, hidden, dtype=dtype) * hidden**-0.5
    w2 = _randn(gen, num_experts, hidden, inter, dtype=dtype) * inter**-0.5
    weights, ids = (t.to(DEVICE) for t in skewed_routing(gen, num_tokens, num_experts, top_k))
    counts = torch.bincount(ids.flatten().cpu(), minlength=num_experts)
    assert counts[-1] == 0 and (num_tokens < 4 or counts[0] >= num_tokens * 3 // 4)
    got = fused_moe(x, w13, w2, weights, ids)
    expected = reference.fused_moe(x, w13, w2, weights, ids)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=4 * atol, rtol=4 * rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,latent,rope,block_size", [(4, 32, 8, 4), (20, 64, 16, 16)])
@matrix
def test_paged_mla_decode(num_heads, latent, rope, block_size, dtype):
    """The latent-space decode kernel against the torch MLA path (whose attention is checked
    against the oracle), over scattered blocks and ragged lengths, heads not a multiple of
    the kernel's head tile."""
    gen = _gen("mla", num_heads, latent, rope, block_size, dtype)
    seq_lens = [1, block_size, 3 * block_size + 5, 40]
    cache, _, tables = _paged_cache(gen, seq_lens, block_size, 1, latent + rope, dtype)
    q = _randn(gen, len(seq_lens), num_heads, latent + rope, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    scale = (latent + rope) ** -0.5
    expected = torch_attention.paged_mla_attention(q, cache, tables, cu, lens, scale, latent)
    _close(paged_mla_decode(q, cache, tables, lens, scale, latent), expected, "mla decode")


def test_align_block_size_groups_slots_by_expert():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 2]])
    sorted_ids, block_expert = align_block_size(ids, 4, 4)
    # slots of expert 0: 1, 4; of 1: 3; of 2: 0, 2, 5, 6, 7 (two tiles); expert 3: none
    assert block_expert.tolist()[:4] == [0, 1, 2, 2] and set(block_expert.tolist()[4:]) <= {-1}
    tiles = sorted_ids.view(-1, 4).tolist()
    assert tiles[:4] == [[1, 4, 8, 8], [3, 8, 8, 8], [0, 2, 5, 6], [7, 8, 8, 8]]


@matrix
def test_public_functions_dispatch_to_triton():
    """kernels.<fn> with the backend forced to Triton matches the reference, for all six."""
    gen = _gen("dispatch")
    previous = kernels.set_backend("triton")
    try:
        x, w = _randn(gen, 3, 32), _randn(gen, 32)
        _close(kernels.rms_norm(x, w, 1e-6, x.clone())[0], reference.rms_norm(x, w, 1e-6, x.clone())[0], "rms_norm")
        _close(kernels.silu_and_mul(x), reference.silu_and_mul(x), "silu_and_mul")
        q, k = _randn(gen, 3, 4, 16), _randn(gen, 3, 2, 16)
        cache, positions = _randn(gen, 8, 16), torch.tensor([0, 5, 7], device=DEVICE)
        _close(kernels.rotary_embedding(positions, q.clone(), k.clone(), cache)[0],
               reference.rotary_embedding(positions, q.clone(), k.clone(), cache)[0], "rotary")
        caches = [torch.zeros(4, 16, 2, 16, device=DEVICE) for _ in range(4)]
        slots = torch.tensor([0, 17, -1], device=DEVICE)
        kernels.store_kv_cache(k, k, caches[0], caches[1], slots)
        reference.store_kv_cache(k, k, caches[2], caches[3], slots)
        _close(caches[0], caches[2], "store_kv_cache")
        tables = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([18, 1], dtype=torch.int32, device=DEVICE)
        _close(kernels.paged_decode_attention(q[:2], caches[0], caches[1], tables, lens, 0.25),
               attention_oracle.paged_decode_attention(q[:2], caches[0], caches[1], tables, lens, 0.25), "decode")
        cu = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
        _close(kernels.paged_prefill_attention(q, caches[0], caches[1], tables, cu, lens, 0.25),
               attention_oracle.paged_prefill_attention(q, caches[0], caches[1], tables, cu, lens, 0.25), "prefill")
    finally:
        kernels.set_backend(previous)


@pytest.mark.skipif(RUNS_HERE, reason="the matrix runs in this process")
def test_interpreter_matrix():
    """Without CUDA: this file in a child pytest under TRITON_INTERPRET=1 (same seed)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PDCLUSTER_KERNEL_SEED": str(SEED)}
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    print(result.stdout[-3000:])
    output = f"{result.stdout[-12000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"interpreted kernel matrix failed:\n{output}"


# ---------------------------------------------------------------- input checks and dispatch


def _cpu_attention_inputs(dtype=torch.float32):
    q = torch.zeros(2, 4, 8, dtype=dtype)
    cache = torch.zeros(4, 16, 2, 8, dtype=dtype)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    return q, cache, cache.clone(), tables, lens


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: {**a, "q": a["q"].double()}, "dtype torch.float64 is not supported"),
        (lambda a: {**a, "block_tables": a["block_tables"].long()}, "block_tables: dtype torch.int64"),
        (lambda a: {**a, "q": torch.zeros(2, 3, 8)}, "not a multiple of num_kv_heads"),
        (lambda a: {**a, "q": torch.zeros(2, 4, 16)}, "head_dim"),
        (lambda a: {**a, "q": torch.zeros(2, 8, 4).transpose(1, 2)}, "last dimension must be contiguous"),
        (lambda a: {**a, "k_cache": a["k_cache"].half()}, "caches: dtype"),
        (lambda a: {**a, "seq_lens": torch.ones(3, dtype=torch.int32)}, "seq_lens: expected contiguous [2]"),
        (lambda a: {**a, "v_cache": torch.zeros(4, 32, 2, 8)}, "v_cache: shape/strides"),
    ],
)
def test_decode_launcher_rejects_bad_inputs(mutate, message):
    q, k_cache, v_cache, tables, lens = _cpu_attention_inputs()
    args = mutate({"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables, "seq_lens": lens})
    with pytest.raises(KernelInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan_paged_decode_attention(**args, scale=1.0)


def test_other_launchers_reject_bad_inputs():
    q, k_cache, v_cache, tables, lens = _cpu_attention_inputs()
    with pytest.raises(KernelInputError, match="cu_seqlens_q"):
        plan_paged_prefill_attention(q, k_cache, v_cache, tables, torch.zeros(2, dtype=torch.int32), lens, 1.0)
    k = torch.zeros(3, 2, 8)
    with pytest.raises(KernelInputError, match="slot_mapping: dtype"):
        plan_store_kv_cache(k, k, k_cache, v_cache, torch.zeros(3))
    with pytest.raises(KernelInputError, match="k_cache: heads/head_dim"):
        wide = torch.zeros(3, 4, 8)
        plan_store_kv_cache(wide, wide, k_cache, v_cache, torch.zeros(3, dtype=torch.long))
    with pytest.raises(KernelInputError, match="weight"):
        plan_rms_norm(torch.zeros(2, 8), torch.zeros(8, dtype=torch.float16), 1e-6)
    with pytest.raises(KernelInputError, match="hidden size"):
        plan_rms_norm(torch.zeros(1, 70000), torch.zeros(70000), 1e-6)
    with pytest.raises(KernelInputError, match=r"\[\.\.\., 2\*d\]"):
        plan_silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(KernelInputError, match="head_dim 7 must be even"):
        plan_rotary_embedding(torch.zeros(2, dtype=torch.long), torch.zeros(2, 1, 7), torch.zeros(2, 1, 7),
                              torch.zeros(4, 7))
    with pytest.raises(KernelInputError, match="positions: dtype"):
        plan_rotary_embedding(torch.zeros(2), torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), torch.zeros(4, 8))


def test_split_heuristic():
    assert choose_num_splits(64 * 8, 4096, 132, 64) == 1  # the decode benchmark fills the GPU
    assert choose_num_splits(1 * 8, 32768, 132, 64) > 8  # one long sequence is split
    assert choose_num_splits(1 * 8, 16, 132, 64) == 1  # one tile: nothing to split
    assert all(choose_num_splits(p, 4096, 132, 64) <= 16 for p in range(1, 200))  # splits >= 256 tokens


def test_backend_selection_and_runtime_env():
    with pytest.raises(ValueError, match="kernel backend"):
        kernels.set_backend("cuda")
    assert kernels.get_backend() == "auto"
    assert kernels.runtime_env_vars("triton", "cpu") == {"TRITON_INTERPRET": "1"}
    assert kernels.runtime_env_vars("triton", "cuda:1") == {}
    assert kernels.runtime_env_vars("auto", "cpu") == {}
    x, w = torch.randn(2, 8), torch.randn(8)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6)[0], reference.rms_norm(x, w, 1e-6)[0])  # auto, CPU


@pytest.mark.skipif(RUNS_HERE, reason="only meaningful without CUDA and without the interpreter")
def test_triton_backend_on_cpu_without_interpreter_fails_clearly():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.set_backend("triton")
    assert kernels.get_backend() == "auto"
    launches, _ = plan_silu_and_mul(torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        launches[0].run()
