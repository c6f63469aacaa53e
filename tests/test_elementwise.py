"""ch05: RMSNorm with the residual add and the rotary embedding in C++
(common/layers/elementwise.py) against the PyTorch reference."""
from __future__ import annotations

import pytest
import torch

from common.layers import elementwise
from common.layers.elementwise import CpuElementwise, TorchElementwise

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    try:
        elementwise.build_extension()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the C++ kernels do not build here: {exc}")


def sample(*shape, dtype, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def assert_norm_close(out, expected, weight):
    """Only the sum of squares is added in another order: its float32 can
    differ in the last bit, and the normalized value then round the other
    way before the weight multiplies it: a step or two of the dtype, on a
    handful of values in 16 bits."""
    eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 * eps,
                               atol=2 * eps * weight.float().abs().max().item())
    if out.dtype != torch.float32:  # (in float32 the last bit moves everywhere)
        assert (out != expected).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_rms_norm(dtype, rows):
    x, weight = sample(rows, 576, dtype=dtype), sample(576, dtype=dtype, seed=1)
    assert_norm_close(CpuElementwise.rms_norm(x, weight, 1e-5),
                      TorchElementwise.rms_norm(x, weight, 1e-5), weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_in_place(dtype):
    x, residual = sample(64, 576, dtype=dtype), sample(64, 576, dtype=dtype, seed=2)
    weight = sample(576, dtype=dtype, seed=1)
    expected_norm, expected_residual = TorchElementwise.add_rms_norm(x, residual, weight, 1e-6)
    x_in, residual_in = x.clone(), residual.clone()
    normed, new_residual = CpuElementwise.add_rms_norm(x_in, residual_in, weight, 1e-6)
    assert normed is x_in and new_residual is residual_in  # in place
    assert torch.equal(new_residual, expected_residual)  # one add, rounded as PyTorch does
    assert_norm_close(normed, expected_norm, weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_a_view_of_the_fused_product_is_bit_exact(dtype):
    """q is a view of q/k/v's one product: rows strided, rotated in place."""
    tokens, heads, kv_heads, dim = 5, 9, 3, 64
    qkv = sample(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    cos, sin = sample(tokens, dim, dtype=dtype, seed=3), sample(tokens, dim, dtype=dtype, seed=4)
    expected_q, expected_k = TorchElementwise.rotary(q, cos, sin), TorchElementwise.rotary(k, cos, sin)
    v_before = v.clone()
    assert CpuElementwise.rotary(q, cos, sin) is q
    CpuElementwise.rotary(k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(v, v_before)  # the rest of the product untouched


def test_the_cpu_gets_the_kernels_or_the_reference_when_they_do_not_build(monkeypatch):
    assert elementwise.elementwise_ops_for(torch.device("cpu")) is CpuElementwise

    def no_compiler():
        raise RuntimeError("Error building extension: g++ not found")

    monkeypatch.setattr(elementwise, "build_extension", no_compiler)
    elementwise.cpu_elementwise_ops.cache_clear()
    try:
        assert elementwise.cpu_elementwise_ops() is TorchElementwise
    finally:
        elementwise.cpu_elementwise_ops.cache_clear()

