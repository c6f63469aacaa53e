"""ch05: bfloat16 products with the weight packed once for oneDNN
(common/layers/cpu_gemm.py) give F.linear's numbers, bit for bit, and the
engine's tokens do not change."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.layers import cpu_gemm
from common.layers.cpu_gemm import PackedLinear, dense_gemm, packs_weights
from common.loader import load_model
from common.memory import weight_bytes
from tests.engine_helpers import greedy, make_engine, run_all

BF16_WEIGHT = torch.zeros(8, 8, dtype=torch.bfloat16)
needs_onednn_bf16 = pytest.mark.skipif(
    not packs_weights(BF16_WEIGHT),
    reason="this CPU's oneDNN has no bfloat16 (torch.ops.mkldnn._is_mkldnn_bf16_supported)")


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_is_f_linear_bit_for_bit(rows, with_bias):
    torch.manual_seed(rows)
    weight = torch.randn(960, 576).bfloat16()  # q/k/v of the embedded model
    bias = torch.randn(960).bfloat16() if with_bias else None
    x = torch.randn(rows, 576).bfloat16()
    assert torch.equal(PackedLinear(weight, bias)(x), F.linear(x, weight, bias))


def test_float32_is_not_packed():
    """Packing float32 measured no faster: it stays F.linear."""
    weight = torch.randn(16, 8)
    gemm = dense_gemm(weight)
    assert not isinstance(gemm, PackedLinear)
    x = torch.randn(3, 8)
    assert torch.equal(gemm(x), F.linear(x, weight))


def bf16_tiny_llama():
    return load_model("tiny-llama", dtype="bfloat16", device="cpu", load_format="dummy")


@needs_onednn_bf16
def test_engine_tokens_do_not_change_and_the_card_pays_for_the_copies(monkeypatch):
    prompts = {f"r{i}": [1 + i, 17, 300 + 7 * i, 42][: 2 + i % 3] for i in range(6)}
    packed_engine = make_engine(bf16_tiny_llama(), dtype="bfloat16")
    packed = run_all(packed_engine, prompts, greedy(16))
    forward = packed_engine.worker.model_runner.model
    hf = forward.hf
    linears = [m for m in hf.modules() if isinstance(m, torch.nn.Linear)]
    assert all(isinstance(g, PackedLinear) for g in forward.o_proj + forward.down_proj)
    assert forward.packed_bytes == sum(m.weight.numel() * 2 for m in linears)  # head included
    assert packed_engine.worker.weight_bytes == weight_bytes(hf) + forward.packed_bytes

    # The same weights (a second dummy load, same seed), nothing packed.
    monkeypatch.setattr(cpu_gemm, "packs_weights", lambda weight: False)
    plain_engine = make_engine(bf16_tiny_llama(), dtype="bfloat16")
    assert plain_engine.worker.model_runner.model.packed_bytes == 0
    plain = run_all(plain_engine, prompts, greedy(16))
    assert {r: o.token_ids for r, o in packed.items()} == \
        {r: o.token_ids for r, o in plain.items()}
