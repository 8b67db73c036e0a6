"""kernels.linear on CPU (the transposed product for decode-sized batches) against a float64
matmul. The merged q/k/v and gate/up loading is checked end to end by the logits-vs-HF tests
(tests/engine/test_paged_logits.py, and test_tensor_parallel.py for the shards)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_gemm


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_a_float64_matmul_at_every_batch_size(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    weight = torch.randn(200, 96, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    out = kernels.linear(x, weight, b)
    expected = x.double() @ weight.double().t() + (b.double() if bias else 0)
    assert out.shape == (rows, 200) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


def test_a_strided_input_row_view_gives_the_same_product():
    """The engine's q/k/v are column slices of one output; a linear may get such views."""
    x = torch.randn(4, 160)[:, 32:128]
    weight = torch.randn(64, 96)
    torch.testing.assert_close(kernels.linear(x, weight), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_decode_sized_batches_take_the_transposed_product_and_larger_ones_f_linear(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_gemm.F, "linear", lambda *a: calls.append(a[0].shape[0]) or
                        a[0] @ a[1].t())
    for rows in (1, cpu_gemm.MAX_SKINNY_ROWS, cpu_gemm.MAX_SKINNY_ROWS + 1):
        kernels.linear(torch.randn(rows, 8), torch.randn(4, 8))
    assert calls == [cpu_gemm.MAX_SKINNY_ROWS + 1]
