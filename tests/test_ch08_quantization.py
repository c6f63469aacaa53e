"""Exercise 08's grading tests: int8 weight-only quantization of one linear
layer (`make exercise CH=08`; the reference is `quantize_int8` and
`int8_linear` in common/layers/quantization.py).

Each test is built to catch a mistake a learner makes: one scale for the
whole tensor, the row's max instead of its largest |w| (negative weights),
floor or truncation instead of rounding, no clamp (128 wraps to -128), the
wrong dtype or shape, a bfloat16 weight quantized in bfloat16, a row of
zeros (0 / 0), the bias forgotten, the weight or the scales on the wrong
axis. The last one runs the embedded model with every linear layer
quantized by the functions under test, through the engine.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from common.config import EngineConfig
from common.engine.parts import assemble_engine
from common.layers import quantization as quant
from common.loader import apply_chat_template
from common.models.llama import LLAMA_LINEARS
from tests.conftest import PROMPTS
from tests.engine_helpers import greedy, run_all

pytestmark = [pytest.mark.ch08, pytest.mark.ex08]

HALF_STEP = 0.5 + 1e-5  # of a row's scale: float32 rounding of q * s leaves a little


def tricky_weight(num_out: int = 48, num_in: int = 80, seed: int = 0) -> torch.Tensor:
    """(num_out, num_in) float32: rows of magnitudes 1e-3 to 10 (one scale
    for all would crush the small rows), a third whose largest |w| is
    negative (every weight <= 0 there), a third all positive."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(num_out, num_in, generator=gen)
    magnitude = torch.logspace(-3, 1, num_out)[torch.randperm(num_out, generator=gen)]
    w = w * magnitude[:, None]
    w[0::3] = -w[0::3].abs()  # rows 0, 3, 6...: all <= 0, the largest |w| negative
    w[1::3] = w[1::3].abs()
    return w


def check_quantized(weight: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    rounding: bool = True) -> None:
    """The contract of quantize_int8, on any weight (`rounding`: every
    weight within half a step too)."""
    num_out, num_in = weight.shape
    assert isinstance(qweight, torch.Tensor) and qweight.dtype == torch.int8, (
        f"qweight must be torch.int8 (1 byte a weight), got {getattr(qweight, 'dtype', qweight)}")
    assert qweight.shape == (num_out, num_in), f"qweight {tuple(qweight.shape)}: expected " \
        f"(out, in) = {(num_out, num_in)}, as the weight"
    assert scales.shape == (num_out,), f"scales {tuple(scales.shape)}: expected one per " \
        f"output row, ({num_out},)"
    assert scales.dtype == torch.float32, f"scales must be float32, got {scales.dtype}"
    assert torch.isfinite(scales).all() and (scales > 0).all(), "every scale finite and > 0"
    assert int(qweight.min()) >= -127 and int(qweight.max()) <= 127, (
        f"q in [{int(qweight.min())}, {int(qweight.max())}]: symmetric int8 keeps [-127, 127]")
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    nonzero = absmax > 0
    torch.testing.assert_close(scales[nonzero], absmax[nonzero] / 127, rtol=1e-5, atol=0,
                               msg=lambda m: "scales[n] must be row n's largest |w| / 127\n" + m)
    if not rounding:
        return
    error = (qweight.float() * scales[:, None] - w).abs()
    worst = (error / scales[:, None]).max().item()
    assert worst <= HALF_STEP, f"a weight is {worst:.2f} of its row's scale from its q * scale: " \
        "rounding to the nearest integer keeps every error within half a step"


def test_quantize_int8_keeps_int8_and_one_float32_scale_per_row(impl):
    """The shapes and dtypes: qweight (N, K) int8 in [-127, 127], scales
    (N,) float32, each row's largest |w| / 127; the weight untouched. (How
    each weight is rounded: the next test.)"""
    weight = tricky_weight(48, 80)
    before = weight.clone()
    qweight, scales = impl.quantize_int8(weight)
    assert torch.equal(weight, before), "quantize_int8 must not change the weight"
    check_quantized(weight, qweight, scales, rounding=False)


@pytest.mark.parametrize("shape", [(48, 80), (96, 64), (7, 7)], ids=["48x80", "96x64", "7x7"])
def test_every_weight_is_within_half_a_step(impl, shape):
    """Round to nearest: |q * scale - w| <= scale / 2, q in [-127, 127]."""
    weight = tricky_weight(*shape, seed=sum(shape))
    check_quantized(weight, *impl.quantize_int8(weight))


def test_each_row_gets_its_own_scale_from_its_largest_absolute_weight(impl):
    """Per output channel, from the absolute maximum: each row's largest |w|
    lands on +127 or -127 with its sign, even where it is negative."""
    weight = tricky_weight(30, 64, seed=1)
    qweight, scales = impl.quantize_int8(weight)
    assert scales.shape == (30,), f"scales {tuple(scales.shape)}: one per output row, (30,)"
    torch.testing.assert_close(scales, weight.abs().amax(dim=1) / 127, rtol=1e-5, atol=0)
    peak = weight.abs().argmax(dim=1)  # (N,): where each row's largest |w| is
    rows = torch.arange(30)
    expected = torch.where(weight[rows, peak] < 0, -127, 127)
    got = qweight[rows, peak].to(torch.int64)
    assert torch.equal(got, expected), f"the largest |w| of each row should be +-127: " \
        f"rows {(got != expected).nonzero().flatten().tolist()} are not"
    small = scales.argmin()  # the smallest row still uses the whole range
    assert int(qweight[small].abs().max()) == 127


def test_the_embedded_models_weights(impl, embedded):
    """The real weights (float32): layers 0 and 29, all seven projections."""
    layers = embedded.model.model.layers
    for layer in (layers[0], layers[-1]):
        for path in LLAMA_LINEARS:
            weight = layer.get_submodule(path).weight.data
            check_quantized(weight, *impl.quantize_int8(weight))


def test_bfloat16_weights_are_quantized_in_float32(impl):
    """`--dtype bfloat16` hands over bfloat16 weights: computed in bfloat16,
    w / scale is only good to 8 bits and the largest lands on 128, which
    wraps to -128 without a clamp."""
    weight = tricky_weight(64, 96, seed=3).bfloat16()
    qweight, scales = impl.quantize_int8(weight)
    check_quantized(weight, qweight, scales)
    reference_q, _ = quant.quantize_int8(weight)
    assert (qweight.to(torch.int16) - reference_q.to(torch.int16)).abs().max() <= 1


def test_a_row_of_zeros_gets_q_0_and_a_positive_scale(impl):
    """A pruned output channel: 0 / 0 is NaN, and NaN cast to int8 hides
    it, but the scale must still be a positive number (clamp the max)."""
    weight = tricky_weight(16, 32, seed=4)
    weight[5] = 0.0
    qweight, scales = impl.quantize_int8(weight)
    assert torch.isfinite(scales).all(), f"scales {scales.tolist()}"
    assert scales[5] > 0, f"the zero row's scale is {scales[5].item()}: clamp the row max " \
        "(the reference uses 1e-12) so that no scale is 0"
    assert torch.equal(qweight[5], torch.zeros(32, dtype=torch.int8))
    check_quantized(weight, qweight, scales)


@pytest.mark.parametrize("shape", [(1, 64, 96), (5, 96, 64), (64, 64, 64), (3, 48, 1)],
                         ids=["decode-1", "rows-5", "square", "one-output"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_int8_linear_is_the_linear_layer_of_the_dequantized_weight(impl, shape, with_bias):
    """x @ (q * s).T + bias, (M, N): on the reference's q and scales, so that
    this grades int8_linear alone. The square case catches a weight (or the
    scales) on the wrong axis that the shapes would let through."""
    num_rows, num_in, num_out = shape
    gen = torch.Generator().manual_seed(num_rows + num_in + num_out)
    qweight, scales = quant.quantize_int8(tricky_weight(num_out, num_in, seed=num_out))
    x = torch.randn(num_rows, num_in, generator=gen)
    bias = torch.randn(num_out, generator=gen) if with_bias else None
    expected = F.linear(x.double(), quant.dequantize_int8(qweight, scales).double(),
                        None if bias is None else bias.double())
    out = impl.int8_linear(x, qweight, scales, bias)
    assert out.shape == (num_rows, num_out), f"output {tuple(out.shape)}: expected (M, N) = " \
        f"{(num_rows, num_out)}"
    assert out.dtype == torch.float32, f"float32 activations in, float32 out: got {out.dtype}"
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_int8_linear_keeps_the_activations_dtype(impl):
    """bfloat16 activations in, bfloat16 out, within bfloat16's precision
    (3 significant digits: the tolerance is 2 % of the largest output)."""
    gen = torch.Generator().manual_seed(5)
    qweight, scales = quant.quantize_int8(torch.randn(32, 64, generator=gen) * 0.05)
    x = torch.randn(4, 64, generator=gen).bfloat16()
    bias = (torch.randn(32, generator=gen) * 0.1).bfloat16()
    out = impl.int8_linear(x, qweight, scales, bias)
    assert out.dtype == torch.bfloat16, f"bfloat16 activations in, bfloat16 out: got {out.dtype}"
    expected = F.linear(x.float(), quant.dequantize_int8(qweight, scales), bias.float())
    torch.testing.assert_close(out.float(), expected, rtol=2e-2,
                               atol=2e-2 * expected.abs().max().item())


def dequantize_then_linear(x: torch.Tensor, layer: quant.QuantLinear) -> torch.Tensor:
    """The definition: the float weight back, then nn.Linear's matmul."""
    w = quant.dequantize_int8(layer.qweight, layer.scales).to(x.dtype)
    return F.linear(x, w, layer.bias)


# the reference int8 engine, written as its definition: the reference's
# quantize_int8, then the float weight back and F.linear at every call
DEFINITION = SimpleNamespace(name="reference quantize_int8, dequantize + F.linear",
                             quantize=quant.ReferenceQuantOps.quantize,
                             linear=dequantize_then_linear)


def int8_engine_tokens(embedded, quant_ops, max_tokens: int = 32):
    """The embedded model (a copy: quantization swaps its layers in place),
    every linear layer of its 30 decoder layers quantized with `quant_ops`,
    three prompts greedy: (engine, request id -> tokens)."""
    loaded = replace(embedded, model=copy.deepcopy(embedded.model))
    engine = assemble_engine(EngineConfig(quantization="int8", device_memory_gb=2.0), loaded=loaded,
                       quant_ops=quant_ops)
    prompts = {f"r{i}": apply_chat_template(embedded.tokenizer, m) for i, m in enumerate(PROMPTS)}
    done = run_all(engine, prompts, greedy(max_tokens))
    return engine, {request_id: out.token_ids for request_id, out in done.items()}


def test_the_engine_with_your_int8_layers_gives_the_reference_tokens(impl, embedded):
    """End to end: every q/k/v/o and gate/up/down projection of the embedded
    model (210 layers) stored by your quantize_int8 and multiplied by your
    int8_linear, through `assemble_engine(quant_ops=...)`: three prompts, 32
    greedy tokens each, the reference int8 engine's tokens exactly, and
    its weights in as many bytes."""
    engine, tokens = int8_engine_tokens(embedded, impl.quant_ops)
    reference, expected = int8_engine_tokens(embedded, DEFINITION)
    layers = [m for m in engine.loaded.model.modules() if isinstance(m, quant.QuantLinear)]
    assert len(layers) == 30 * len(LLAMA_LINEARS)
    assert all(layer.qweight.dtype == torch.int8 for layer in layers)
    assert engine.worker.weight_bytes == reference.worker.weight_bytes, (
        "the quantized model should take the reference's bytes: 1 per weight, 4 per scale")
    for request_id, ids in expected.items():
        assert tokens[request_id] == ids, request_id
