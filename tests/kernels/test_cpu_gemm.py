"""kernels.linear with oneDNN-packed CPU weights, and with the skinny or tile GEMM's copy,
against a float64 matmul. The merged q/k/v and gate/up loading, and the packing of every weight at load,
are checked end to end by the logits-vs-HF tests (tests/engine/test_paged_logits.py, and
test_tensor_parallel.py for the shards)."""

from __future__ import annotations

import pytest
import torch

from pdcluster import kernels
from pdcluster.kernels import cpu_extension, cpu_gemm, reference

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="torch built without oneDNN")


def _case(rows: int, bias: bool, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = torch.randn(200, 96, generator=gen).to(dtype)
    b = torch.randn(200, generator=gen).to(dtype) if bias else None
    expected = x.double() @ weight.double().t() + (b.double() if bias else 0)
    return x, weight, b, expected


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 33, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_a_float64_matmul_at_every_batch_size(rows, bias):
    x, weight, b, expected = _case(rows, bias, torch.float32)
    packed = kernels.pack_linear_weight(weight)
    assert packed.is_mkldnn and tuple(packed.shape) == (200, 96)
    out = kernels.linear(x, packed, b)
    assert out.shape == (rows, 200) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available()
                    or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="no oneDNN bf16 kernels on this CPU")
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_bf16_packed_linear_accumulates_in_fp32(rows):
    """bf16 inputs and weights, one bf16 rounding of an fp32 sum: within bf16's half-ulp of
    the exact product of the same bf16 values, for sums of 96 terms."""
    x, weight, b, expected = _case(rows, True, torch.bfloat16)
    out = kernels.linear(x, kernels.pack_linear_weight(weight), b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-2)


def test_a_strided_input_row_view_gives_the_same_product():
    """The engine's q/k/v are column slices of one output; a linear may get such views."""
    x = torch.randn(4, 160)[:, 32:128]
    weight = torch.randn(64, 96)
    torch.testing.assert_close(kernels.linear(x, kernels.pack_linear_weight(weight)),
                               x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_a_weight_onednn_cannot_pack_stays_dense_and_runs_f_linear():
    weight = torch.randn(64, 96, dtype=torch.float64)
    assert not cpu_gemm.can_pack(weight)
    assert kernels.pack_linear_weight(weight) is weight
    x = torch.randn(3, 96, dtype=torch.float64)
    torch.testing.assert_close(kernels.linear(x, weight), x @ weight.t())
    with pytest.raises(ValueError, match="cannot pack"):
        cpu_gemm.pack(weight)


def test_packing_leaves_the_dense_weight_as_it_was():
    weight = torch.randn(64, 96)
    before = weight.clone()
    kernels.pack_linear_weight(weight)
    assert torch.equal(weight, before)


# ---- the skinny GEMM for decode batches ---------------------------------------------------

needs_skinny = pytest.mark.skipif(not cpu_gemm.can_pack_skinny(torch.zeros(1, 1)),
                                  reason="C++ kernels not built")


@needs_skinny
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [97, 600])
def test_skinny_linear_matches_a_float64_matmul_at_every_row_count(rows, bias, in_features):
    """Rows are taken 6 at a time with 1..5 left over, and 1 or 2 rows split k over several
    accumulators: every path is hit. 200 outputs leave a partial last tile; K = 97 leaves a
    partial k-unroll; K = 600 is a longer k loop over a tile larger than L1."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(200, in_features, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    expected = x.double() @ weight.double().t() + (b.double() if bias else 0)
    skinny = kernels.pack_skinny_weight(weight)
    assert (skinny is not None and skinny.shape[1] == in_features
            and skinny.shape[0] * skinny.shape[2] >= 200)
    out = kernels.linear(x, kernels.pack_linear_weight(weight), b, skinny)
    assert out.shape == (rows, 200) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


@needs_skinny
def test_skinny_linear_on_a_dense_weight_and_leading_dims():
    """Where oneDNN cannot pack (the weight stays dense) the skinny copy still serves few rows;
    x may have leading dims and be a strided column view."""
    weight = torch.randn(70, 96)
    x = torch.randn(2, 3, 160)[..., 32:128]
    out = kernels.linear(x, weight, skinny=kernels.pack_skinny_weight(weight))
    assert out.shape == (2, 3, 70)
    torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-5)


@needs_skinny
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_bf16_skinny_linear_rounds_an_fp32_sum_once(rows):
    """bf16 in, bf16 out, on any CPU (the kernel widens bf16 itself): within bf16's half-ulp of
    the exact product of the same bf16 values."""
    x, weight, b, expected = _case(rows, True, torch.bfloat16)
    out = kernels.linear(x, weight, b, kernels.pack_skinny_weight(weight))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-2)


@needs_skinny
def test_more_rows_than_the_skinny_limit_take_the_other_gemm():
    """Above SKINNY_MAX_ROWS the skinny copy is not read: a copy of zeros changes nothing."""
    weight = torch.randn(64, 96)
    zeros = kernels.pack_skinny_weight(torch.zeros_like(weight))
    many = torch.randn(cpu_gemm.SKINNY_MAX_ROWS + 1, 96)
    torch.testing.assert_close(kernels.linear(many, weight, skinny=zeros), many @ weight.t(),
                               rtol=1e-5, atol=1e-5)
    few = many[:cpu_gemm.SKINNY_MAX_ROWS]
    assert torch.count_nonzero(kernels.linear(few, weight, skinny=zeros)) == 0


@needs_skinny
@pytest.mark.parametrize("amx", [True, False])
def test_bf16_on_amx_takes_the_tile_gemm_s_copy_up_to_its_rows(monkeypatch, amx):
    """Where the CPU has AMX (and torch's brgemm runs there), the bfloat16 copy is the tile
    GEMM's and takes batches of up to AMX_MAX_ROWS rows; elsewhere it is the skinny GEMM's,
    up to SKINNY_MAX_ROWS. float32 keeps SKINNY_MAX_ROWS. Above the limit the copy is not
    read: a copy of zeros changes nothing."""
    monkeypatch.setattr(cpu_gemm, "has_amx", lambda: amx)
    cpu_gemm.skinny_max_rows.cache_clear()
    cpu_gemm.uses_amx_gemm.cache_clear()
    try:
        tiles = cpu_gemm.uses_amx_gemm(torch.bfloat16)
        assert tiles == (amx and cpu_extension.module().amx_gemm_supported())
        limit = cpu_gemm.AMX_MAX_ROWS if tiles else cpu_gemm.SKINNY_MAX_ROWS
        assert cpu_gemm.skinny_max_rows(torch.bfloat16) == limit
        assert cpu_gemm.skinny_max_rows(torch.float32) == cpu_gemm.SKINNY_MAX_ROWS
        weight = torch.randn(64, 96, dtype=torch.bfloat16)
        zeros = kernels.pack_skinny_weight(torch.zeros_like(weight))
        assert cpu_gemm.is_amx_copy(zeros) == tiles
        many = torch.randn(limit + 1, 96, dtype=torch.bfloat16)
        assert torch.count_nonzero(kernels.linear(many, weight, skinny=zeros)) > 0
        assert torch.count_nonzero(kernels.linear(many[:limit], weight, skinny=zeros)) == 0
    finally:
        cpu_gemm.skinny_max_rows.cache_clear()
        cpu_gemm.uses_amx_gemm.cache_clear()


needs_amx_gemm = pytest.mark.skipif(
    not (cpu_extension.available() and cpu_gemm.uses_amx_gemm(torch.bfloat16)),
    reason="the tile GEMM needs AMX and the C++ extension")


@needs_amx_gemm
@pytest.mark.parametrize("rows", [1, 2, 17, 300, 1024])
@pytest.mark.parametrize("out_features", [64, 200, 1000])
@pytest.mark.parametrize("in_features", [96, 600])
def test_tile_gemm_rounds_an_fp32_sum_once(rows, out_features, in_features):
    """The tile GEMM's copy, bias and all, at decode and prefill row counts, with output
    widths that leave a narrower last block (200, 1000) and none (64), and an input width
    that a block of many rows takes in several chunks with a shorter last (600): within
    bfloat16's half-ulp of the exact product of the same bfloat16 values."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    copy = kernels.pack_skinny_weight(weight)
    assert cpu_gemm.is_amx_copy(copy) and copy.numel() == weight.numel()
    out = kernels.linear(x, kernels.pack_linear_weight(weight), b, copy)
    expected = x.double() @ weight.double().t() + b.double()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-2)


@needs_amx_gemm
@pytest.mark.parametrize("rows", [1, 17, 300, 1024])
@pytest.mark.parametrize("d, bias", [(64, False), (192, True), (100, True)])
@pytest.mark.parametrize("in_features", [96, 600])
def test_silu_and_mul_on_the_tile_gemm_matches_torch_s_ops(rows, d, bias, in_features):
    """silu(gate) * up of a gate | up projection: fused into the tile GEMM where both halves
    are whole column blocks (64, 192), the two ops elsewhere (100). Against torch's silu and
    product of the bf16-rounded exact projection: silu's result may round to the neighbouring
    bfloat16 (our silu is within float32 ulps of torch's), so two roundings' worth; and value
    for value the same as our unfused path."""
    gen = torch.Generator().manual_seed(rows * d + bias + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(2 * d, in_features, generator=gen) / 4).to(torch.bfloat16)
    b = torch.randn(2 * d, generator=gen).to(torch.bfloat16) if bias else None
    copy, packed = kernels.pack_skinny_weight(weight), kernels.pack_linear_weight(weight)
    fused = cpu_gemm.linear_silu_and_mul(x, packed, b, copy)
    assert (fused is not None) == (d % 64 == 0)
    out = kernels.linear_silu_and_mul(x, packed, b, copy)
    exact = x.double() @ weight.double().t() + (0 if b is None else b.double())
    gate_up = exact.to(torch.bfloat16)
    expected = torch.nn.functional.silu(gate_up[:, :d]) * gate_up[:, d:]
    assert out.dtype == torch.bfloat16 and out.shape == (rows, d)
    torch.testing.assert_close(out.double(), expected.double(), rtol=2**-6, atol=1e-2)
    assert torch.equal(out, kernels.silu_and_mul(kernels.linear(x, packed, b, copy)))


@needs_amx_gemm
@pytest.mark.parametrize("rows", [1, 17, 300, 1024])
@pytest.mark.parametrize("head_dim, heads, bias", [(64, (4, 2, 2), False), (128, (2, 1, 1), True),
                                                   (80, (2, 1, 1), True)])
@pytest.mark.parametrize("in_features", [96, 600])
def test_rope_on_the_tile_gemm_matches_torch_s_ops(rows, head_dim, heads, bias, in_features):
    """A q | k | v projection with RoPE on q and k: fused into the tile GEMM where a head is
    one or two whole column blocks (64, 128), the two ops elsewhere (80). Against torch's
    rotate-half (kernels.reference) of the bf16-rounded exact projection at scattered
    positions, within two roundings; and value for value the same as the unfused path."""
    q_heads, k_heads, v_heads = heads
    out_features = (q_heads + k_heads + v_heads) * head_dim
    q_size, k_size = q_heads * head_dim, k_heads * head_dim
    gen = torch.Generator().manual_seed(rows * head_dim + bias + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=gen) / 4).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    copy, packed = kernels.pack_skinny_weight(weight), kernels.pack_linear_weight(weight)
    fused = cpu_gemm.linear_rope(x, packed, b, copy, positions, cos_sin, q_size + k_size,
                                 head_dim)
    assert (fused is not None) == (head_dim % 64 == 0)
    out = kernels.linear_qk_rope(x, packed, b, copy, positions, cos_sin, q_size, k_size,
                                 head_dim)
    exact = (x.double() @ weight.double().t() + (0 if b is None else b.double()))
    expected = exact.to(torch.bfloat16)
    reference.rotary_embedding(positions, expected[:, :q_size].view(rows, -1, head_dim),
                               expected[:, q_size:q_size + k_size].view(rows, -1, head_dim),
                               cos_sin)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.double(), expected.double(), rtol=2**-6, atol=3e-2)
    unfused = kernels.linear(x, packed, b, copy)
    kernels.rotary_embedding(positions, unfused[:, :q_size].view(rows, -1, head_dim),
                             unfused[:, q_size:q_size + k_size].view(rows, -1, head_dim), cos_sin)
    assert torch.equal(out, unfused)


@needs_amx_gemm
def test_rope_on_the_tile_gemm_refuses_a_position_outside_the_cache():
    weight = torch.randn(192, 96, dtype=torch.bfloat16)
    copy = kernels.pack_skinny_weight(weight)
    cos_sin = torch.zeros(16, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_gemm.linear_rope(torch.randn(2, 96, dtype=torch.bfloat16), weight, None, copy,
                             torch.tensor([3, 16]), cos_sin, 128, 64)


@needs_amx_gemm
def test_tile_gemm_reads_a_strided_x_and_refuses_a_copy_of_another_shape():
    weight = torch.randn(130, 96, dtype=torch.bfloat16)
    copy = kernels.pack_skinny_weight(weight)
    x = torch.randn(40, 160, dtype=torch.bfloat16)[:, 32:128]
    torch.testing.assert_close(kernels.linear(x, weight, skinny=copy).double(),
                               x.double() @ weight.double().t(), rtol=2**-8, atol=1e-2)
    with pytest.raises(RuntimeError, match="columns"):
        kernels.linear(torch.randn(3, 80, dtype=torch.bfloat16),
                       torch.randn(130, 80, dtype=torch.bfloat16), skinny=copy)


@needs_amx_gemm
def test_an_odd_number_of_inputs_gets_no_tile_copy_and_stays_on_onednn():
    """The tile unit multiplies pairs along the input: an odd width has no tile copy, and
    `linear` runs oneDNN for it."""
    weight = torch.randn(64, 95, dtype=torch.bfloat16)
    assert kernels.pack_skinny_weight(weight) is None
    x = torch.randn(5, 95, dtype=torch.bfloat16)
    torch.testing.assert_close(kernels.linear(x, kernels.pack_linear_weight(weight)).double(),
                               x.double() @ weight.double().t(), rtol=2**-8, atol=1e-2)


@needs_skinny
def test_a_skinny_copy_of_another_shape_is_refused():
    skinny = kernels.pack_skinny_weight(torch.randn(64, 96))
    with pytest.raises(RuntimeError, match="in_features"):
        kernels.linear(torch.randn(2, 80), torch.randn(64, 80), skinny=skinny)
    with pytest.raises(ValueError, match="skinny"):
        cpu_gemm.pack_skinny(torch.randn(64, 96, dtype=torch.float64))


@needs_skinny
def test_the_compiled_graph_s_handle_reaches_the_skinny_copy():
    weight = torch.randn(64, 96)
    packed = kernels.pack_linear_weight(weight)
    skinny = kernels.pack_skinny_weight(torch.zeros_like(weight))  # zeros: visible if used
    handle = kernels.linear_handle(packed, skinny)
    x = torch.randn(3, 96)
    assert torch.count_nonzero(kernels.linear_by_handle(x, handle, 64)) == 0
    dense_handle = kernels.linear_handle(weight, kernels.pack_skinny_weight(weight))
    assert dense_handle is not None
    torch.testing.assert_close(kernels.linear_by_handle(x, dense_handle, 64), x @ weight.t(),
                               rtol=1e-5, atol=1e-5)
