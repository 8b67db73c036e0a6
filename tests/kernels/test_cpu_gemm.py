"""kernels.linear with oneDNN-packed CPU weights against a float64 matmul. The merged q/k/v
and gate/up loading, and the packing of every weight at load, are checked end to end by the
logits-vs-HF tests (tests/engine/test_paged_logits.py, and test_tensor_parallel.py for the
shards)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_gemm

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
