"""ch05: products with the weight packed once for oneDNN
(common/layers/cpu_gemm.py) give F.linear's numbers (bit for bit in
bfloat16, to rounding in float32), the engine's tokens do not change, and
an engine that loaded its own model frees the plain weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.layers import cpu_gemm
from common.layers.cpu_gemm import OneDnnLinear, PackedLinear, dense_gemm, packs_weights
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


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="this PyTorch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_float32_is_packed_and_gives_f_linears_numbers_to_rounding(rows):
    """float32 goes through oneDNN's packed product too: its sums may round
    differently from MKL's (F.linear), never by more than rounding."""
    torch.manual_seed(rows)
    weight, bias = torch.randn(960, 576), torch.randn(960)
    gemm = dense_gemm(weight, bias)
    assert isinstance(gemm, PackedLinear)
    x = torch.randn(rows, 576)
    torch.testing.assert_close(gemm(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_an_engine_that_loads_its_model_frees_the_plain_weights_and_keeps_its_tokens():
    """Served (the engine loaded the model): the packed copies are all it
    reads, the plain weights are freed, and the card pays for one copy;
    float32's tied head stays plain (its copy would be a second one).
    The tokens are those of an engine beside a whole HF model."""
    prompts = {f"r{i}": [1 + i, 17, 300 + 7 * i, 42][: 2 + i % 3] for i in range(6)}
    config = dict(model="tiny-llama", load_format="dummy", dtype="float32", device="cpu")
    shared = load_model("tiny-llama", dtype="float32", device="cpu", load_format="dummy")
    whole_bytes = weight_bytes(shared.model)
    beside = run_all(make_engine(shared, **config), prompts, greedy(16))
    assert weight_bytes(shared.model) == whole_bytes  # a shared model stays whole

    served = make_engine(None, **config)
    forward = served.worker.model_runner.model
    layer = forward.hf.model.layers[0]
    assert all(m.weight.numel() == 0 for m in (layer.self_attn.q_proj, layer.self_attn.o_proj,
                                               layer.mlp.gate_proj, layer.mlp.down_proj))
    assert isinstance(forward.lm_head, OneDnnLinear)  # tied, float32: no second copy
    assert served.worker.weight_bytes == whole_bytes  # packed copies in place of the plain ones
    alone = run_all(served, prompts, greedy(16))
    assert {r: o.token_ids for r, o in alone.items()} == \
        {r: o.token_ids for r, o in beside.items()}


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


@needs_onednn
def test_an_untied_head_is_packed_and_its_plain_weight_freed_a_tied_one_kept():
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.models import build_forward
    from common.loader import DUMMY_CONFIGS

    for tied in (False, True):
        config: LlamaConfig = DUMMY_CONFIGS["tiny-llama"]()
        config.tie_word_embeddings = tied
        torch.manual_seed(0)
        hf = LlamaForCausalLM(config).eval()
        head = hf.lm_head.weight.detach().clone()  # (vocab, hidden)
        forward = build_forward(hf)
        forward.release_plain_weights()
        hidden = torch.randn(3, config.hidden_size)
        torch.testing.assert_close(forward.lm_head(hidden), F.linear(hidden, head),
                                   rtol=1e-5, atol=1e-4)
        assert hf.model.embed_tokens.weight.numel() == head.numel()  # the embedding stays
        assert (hf.lm_head.weight.numel() == 0) == (not tied)
