"""Torch reference kernels and the attention oracle vs independent dense computations."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels import reference
from tests.kernels import attention_oracle
from tests.kernels.routing import skewed_routing

BLOCK_SIZE = 4
NUM_BLOCKS = 32
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 16


def _empty_caches() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.zeros(shape), torch.zeros(shape)


def _slots(block_table: list[int], positions: range) -> list[int]:
    return [block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, H, D] are the last L of S positions; k/v [S, Hkv, D]. Explicit bottom-right mask."""
    num_new, seq_len = q.shape[0], k.shape[0]
    mask = torch.ones(num_new, seq_len, dtype=torch.bool).tril(diagonal=seq_len - num_new)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def test_store_kv_cache_writes_slots_and_skips_padding():
    k_cache, v_cache = _empty_caches()
    k = torch.randn(5, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(5, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([7, -1, 0, 33, -1])
    reference.store_kv_cache(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM), v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    for row, slot in ((0, 7), (2, 0), (3, 33)):
        assert torch.equal(flat_k[slot], k[row]) and torch.equal(flat_v[slot], v[row])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[[7, 0, 33]] = True
    assert flat_k[~written].abs().sum() == 0 and flat_v[~written].abs().sum() == 0


def test_prefill_attention_matches_dense_causal_attention():
    torch.manual_seed(0)
    k_cache, v_cache = _empty_caches()
    order = torch.randperm(NUM_BLOCKS).tolist()
    # (cached prefix, new tokens): a fresh prompt, a chunk after a prefix, a one-token decode.
    shapes = [(0, 7), (9, 6), (12, 1)]
    tables, dense_kv, queries = [], [], []
    for seq_index, (prefix, num_new) in enumerate(shapes):
        seq_len = prefix + num_new
        table = order[seq_index * 8 : seq_index * 8 + -(-seq_len // BLOCK_SIZE)]
        k, v = torch.randn(2, seq_len, NUM_KV_HEADS, HEAD_DIM).unbind(0)
        reference.store_kv_cache(k, v, k_cache, v_cache, torch.tensor(_slots(table, range(seq_len))))
        tables.append(table)
        dense_kv.append((k, v))
        queries.append(torch.randn(num_new, NUM_HEADS, HEAD_DIM))
    block_tables = torch.zeros(len(shapes), max(map(len, tables)), dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table)
    cu = torch.tensor([0, 7, 13, 14], dtype=torch.int32)
    seq_lens = torch.tensor([p + n for p, n in shapes], dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    q = torch.cat(queries)
    out = attention_oracle.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, seq_lens, scale)
    expected = torch.cat([_dense_causal(q, k, v, scale) for q, (k, v) in zip(queries, dense_kv)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_prefill_with_one_query(dtype):
    torch.manual_seed(1)
    k_cache, v_cache = (c.to(dtype) for c in _empty_caches())
    order = torch.randperm(NUM_BLOCKS).tolist()
    seq_lens_list = [1, 5, 8, 13]
    block_tables = torch.zeros(len(seq_lens_list), 4, dtype=torch.int32)
    for row, seq_len in enumerate(seq_lens_list):
        table = order[row * 4 : row * 4 + 4]
        block_tables[row] = torch.tensor(table)
        k, v = torch.randn(2, seq_len, NUM_KV_HEADS, HEAD_DIM).unbind(0)
        reference.store_kv_cache(k, v, k_cache, v_cache, torch.tensor(_slots(table, range(seq_len))))
    q = torch.randn(len(seq_lens_list), NUM_HEADS, HEAD_DIM, dtype=dtype)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    cu = torch.arange(len(seq_lens_list) + 1, dtype=torch.int32)
    decode = attention_oracle.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.3)
    prefill = attention_oracle.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, seq_lens, 0.3)
    assert decode.dtype == dtype
    torch.testing.assert_close(decode, prefill, atol=1e-5, rtol=1e-5)


def test_rms_norm_fused_residual_semantics():
    torch.manual_seed(2)
    x, residual, weight = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32)
    out, new_residual = reference.rms_norm(x, weight, 1e-6, residual)
    summed = x + residual
    expected = weight * summed / torch.sqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(new_residual, summed)
    torch.testing.assert_close(out, expected)
    plain_out, passthrough = reference.rms_norm(x, weight, 1e-6)
    assert passthrough is x
    torch.testing.assert_close(plain_out, torch.nn.functional.rms_norm(x, (32,), weight, 1e-6))


def test_silu_and_mul_and_rotary():
    torch.manual_seed(3)
    x = torch.randn(4, 10)
    torch.testing.assert_close(reference.silu_and_mul(x), torch.sigmoid(x[:, :5]) * x[:, :5] * x[:, 5:])
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    angles = torch.rand(10, 4) * 6  # [max_position, D/2]
    angles[0] = 0.0  # position 0: no rotation, as rope_cos_sin_cache builds it
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), -1)
    positions = torch.tensor([7, 0, 3])
    q_rot, k_rot = reference.rotary_embedding(positions, q.clone(), k.clone(), cos_sin_cache)
    # Rotate-half pairs element i with i + D/2: check as complex multiplication by e^{i*angle}.
    rotation = torch.polar(torch.ones(3, 1, 4), angles[positions][:, None, :])
    as_complex = torch.complex(q[..., :4], q[..., 4:]) * rotation
    torch.testing.assert_close(q_rot, torch.cat((as_complex.real, as_complex.imag), -1))
    assert k_rot.shape == k.shape and torch.allclose(k_rot.norm(dim=-1), k.norm(dim=-1))
    torch.testing.assert_close(k_rot[1], k[1])  # position 0: identity


def test_rotary_is_in_place():
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    cos_sin_cache = torch.randn(5, 8)
    q_out, k_out = reference.rotary_embedding(torch.tensor([1, 2]), q, k, cos_sin_cache)
    assert q_out is q and k_out is k


def test_fused_moe_equals_each_token_through_its_experts():
    """The grouped reference against the definition, one (token, slot) at a time, on a batch
    where expert 0 takes most tokens and the last expert none."""
    gen = torch.Generator().manual_seed(5)
    num_tokens, num_experts, top_k, hidden, inter = 29, 6, 2, 16, 24
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(num_experts, hidden, inter, generator=gen)
    weights, ids = skewed_routing(gen, num_tokens, num_experts, top_k)
    expected = torch.zeros(num_tokens, hidden)
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(reference.fused_moe(x, w13, w2, weights, ids), expected,
                               atol=1e-4, rtol=1e-5)
