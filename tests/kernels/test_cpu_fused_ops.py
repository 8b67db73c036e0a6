"""The C++ elementwise ops of a decoder layer (kernels.cpu_fused_ops) against the torch
reference (kernels.reference), on the strided views the model hands them, at widths with and
without a vector tail, on one thread and on several, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels import cpu_extension, cpu_fused_ops, reference
from tests.real_parts import real_part

pytestmark = real_part("the C++ CPU extension", cpu_extension.available(),
                       "the C++ kernels cannot be built here (no compiler)")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [3, 40])  # below and above the rows that wake the threads
@pytest.mark.parametrize("hidden", [768, 40])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_the_reference(threads, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = 3 * torch.randn(rows, hidden, generator=gen)
    residual = torch.randn(rows, hidden, generator=gen) if with_residual else None
    weight = torch.randn(hidden, generator=gen)
    x_before = x.clone()
    want_out, want_residual = reference.rms_norm(x, weight, 1e-5, residual)
    got_out, got_residual = cpu_fused_ops.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_residual, want_residual, rtol=0, atol=0)
    assert torch.equal(x, x_before)  # inputs are not written


@pytest.mark.parametrize("d", [2048, 24])
def test_silu_and_mul_matches_the_reference_over_a_wide_range(threads, d):
    """Gates of +-80: exp of either sign must neither overflow nor lose the small values."""
    gen = torch.Generator().manual_seed(d)
    x = 20 * torch.randn(33, 2 * d, generator=gen)
    x[0, :8] = torch.tensor([-80.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 80.0, -0.5])
    torch.testing.assert_close(cpu_fused_ops.silu_and_mul(x), reference.silu_and_mul(x),
                               rtol=2e-6, atol=1e-6)


def merged_projection(tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      gen: torch.Generator):
    """q, k, v as the model has them: strided views of one qkv projection's output."""
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    return (q.view(tokens, num_heads, head_dim), k.view(tokens, num_kv_heads, head_dim),
            v.view(tokens, num_kv_heads, head_dim))


@pytest.mark.parametrize("head_dim", [64, 80])  # half of 80 leaves a scalar tail
@pytest.mark.parametrize("tokens", [2, 37])
def test_rotary_matches_the_reference_in_place_on_strided_views(threads, head_dim, tokens):
    gen = torch.Generator().manual_seed(head_dim + tokens)
    q, k, _ = merged_projection(tokens, 6, 2, head_dim, gen)
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(512).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    want_q, want_k = q.clone(), k.clone()
    reference.rotary_embedding(positions, want_q, want_k, cos_sin)
    got_q, got_k = cpu_fused_ops.rotary_embedding(positions, q, k, cos_sin)
    assert got_q is q and got_k is k
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)


def test_bfloat16_ops_match_the_reference_to_one_rounding(threads):
    """bfloat16 in and out, float32 inside, intermediates rounded where the reference's torch
    ops round them: at most one bfloat16 step from the reference."""
    gen = torch.Generator().manual_seed(7)
    bf16 = torch.bfloat16
    x, residual = (torch.randn(40, 776, generator=gen).to(bf16) for _ in range(2))
    weight = torch.randn(776, generator=gen).to(bf16)
    for got, want in zip(cpu_fused_ops.rms_norm(x, weight, 1e-5, residual),
                         reference.rms_norm(x, weight, 1e-5, residual)):
        assert got.dtype == bf16
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    gate_up = (8 * torch.randn(40, 2 * 776, generator=gen)).to(bf16)
    torch.testing.assert_close(cpu_fused_ops.silu_and_mul(gate_up),
                               reference.silu_and_mul(gate_up), rtol=1.6e-2, atol=1e-2)
    q, k, v = (t.to(bf16) for t in merged_projection(37, 6, 2, 80, gen))
    positions = torch.randint(0, 64, (37,), generator=gen)
    cos_sin = torch.rand(64, 80, generator=gen)
    want_q, want_k = q.clone(), k.clone()
    reference.rotary_embedding(positions, want_q, want_k, cos_sin)
    cpu_fused_ops.rotary_embedding(positions, q, k, cos_sin)
    torch.testing.assert_close(q, want_q, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(k, want_k, rtol=1.6e-2, atol=1e-2)
    k_cache, v_cache = torch.zeros(10, 8, 2, 80, dtype=bf16), torch.zeros(10, 8, 2, 80, dtype=bf16)
    slots = torch.randperm(80, generator=gen)[:37]
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(k, v, want_k_cache, want_v_cache, slots)
    cpu_fused_ops.store_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)


def test_mixed_dtypes_keep_the_torch_path():
    assert not cpu_fused_ops.supports(torch.zeros(2, 4), torch.zeros(4, dtype=torch.bfloat16))
    assert not cpu_fused_ops.supports(torch.zeros(2, 4, dtype=torch.float16))


def test_rotary_refuses_a_position_beyond_the_cache():
    gen = torch.Generator().manual_seed(0)
    q, k, _ = merged_projection(2, 4, 2, 16, gen)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_fused_ops.rotary_embedding(torch.tensor([0, 64]), q, k, torch.zeros(64, 16))


@pytest.mark.parametrize("tokens", [3, 40])
def test_store_kv_cache_matches_the_reference_and_skips_padding(threads, tokens):
    gen = torch.Generator().manual_seed(tokens)
    _, k, v = merged_projection(tokens, 6, 2, 32, gen)
    caches = [torch.randn(20, 8, 2, 32, generator=gen) for _ in range(2)]
    slots = torch.randperm(160, generator=gen)[:tokens]
    slots[1] = -1
    want_k, want_v = caches[0].clone(), caches[1].clone()
    reference.store_kv_cache(k, v, want_k, want_v, slots)
    cpu_fused_ops.store_kv_cache(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v)


def test_store_kv_cache_refuses_a_slot_beyond_the_cache_and_writes_nothing():
    gen = torch.Generator().manual_seed(1)
    _, k, v = merged_projection(2, 2, 2, 16, gen)
    k_cache, v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_fused_ops.store_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 8]))
    assert not k_cache.any() and not v_cache.any()
