"""Chapter 08: weight-only quantization (`--quantization int8 | int4`).

- the rounding and the packing, on the embedded model's own weights;
- three implementations of one interface agree: the PyTorch reference
  (dequantize + matmul), PyTorch's packed CPU kernels, and the Triton
  kernels (under the interpreter on the CPU);
- in the engine: int4 through the reference gives exactly float32's greedy
  tokens on the embedded model (its weights were 4-bit blocks of 32 all
  along), the card books the small weights and holds more KV blocks.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.config import EngineConfig
from common.worker.kv_cache import KVCache, num_blocks_for_card
from common.engine.llm_engine import LLMEngine
from common.engine.parts import assemble_engine
from common.layers import quantization as quant
from common.loader import apply_chat_template, load_model
from common.models.llama import LLAMA_LINEARS
from common.memory import Card, weight_bytes
from tests.conftest import PROMPTS, ROOT, hf_greedy
from tests.engine_helpers import greedy, run_all
from tests.test_triton_kernels import ON_CUDA, use_triton_interpreter

if not ON_CUDA:
    use_triton_interpreter()  # before common.layers.quant_kernels defines its kernels
from common.layers import quant_kernels  # noqa: E402

pytestmark = pytest.mark.ch08
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


def random_linear(out_features: int, in_features: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=False)
    torch.nn.init.normal_(layer.weight, std=0.05)
    return layer


def reference_out(x: torch.Tensor, layer: quant.QuantLinear) -> torch.Tensor:
    return quant.ReferenceQuantOps.linear(x, layer)


# ------------------------------------------------------------ rounding
def test_int4_recovers_the_embedded_models_weights_exactly(embedded):
    """The shipped GGUF is Q4_1 (groups of 32, float16 scale and min): our
    round-to-nearest lands back on the same grid, so nothing is lost."""
    layers = embedded.model.model.layers
    for layer in (layers[0], layers[17], layers[-1]):
        for path in LLAMA_LINEARS:
            weight = layer.get_submodule(path).weight.data
            q, scales, mins = quant.quantize_int4(weight)
            restored = quant.dequantize_int4(quant.pack_int4(q), scales, mins)
            assert torch.equal(restored, weight), path


def test_int8_error_is_at_most_half_a_step():
    weight = random_linear(96, 64).weight.data
    q, scales = quant.quantize_int8(weight)
    error = (quant.dequantize_int8(q, scales) - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()
    assert q.dtype == torch.int8 and q.abs().max() <= 127


def test_pack_unpack_round_trip():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = quant.pack_int4(q)
    assert packed.shape == (5, 32)
    assert torch.equal(quant.unpack_int4(packed), q)
    assert torch.equal(packed[:, 0] & 0xF, q[:, 0]) and torch.equal(packed[:, 0] >> 4, q[:, 1])


def test_int4_refuses_a_width_that_groups_cannot_cut():
    with pytest.raises(ValueError, match="divisible by 32"):
        quant.quantize_int4(torch.randn(8, 48))


# ------------------------------------------------- one interface, three ops
@pytest.mark.parametrize("scheme", list(quant.QuantScheme), ids=str)
@pytest.mark.parametrize("num_rows", [1, 7, 40])
def test_cpu_packed_kernels_match_the_reference(scheme, num_rows):
    linear = random_linear(96, 128)
    fast = quant.QuantLinear(linear, scheme, quant.CpuPackedQuantOps)
    ref = quant.QuantLinear(linear, scheme, quant.ReferenceQuantOps)
    x = torch.randn(num_rows, 128)
    expected = reference_out(x, ref)
    # the packed kernels round the activations to bfloat16 (3 significant digits)
    torch.testing.assert_close(fast(x), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("scheme", list(quant.QuantScheme), ids=str)
@pytest.mark.parametrize("shape", [(1, 64, 96), (5, 96, 64), (17, 128, 160)],
                         ids=["decode-1", "rows-5", "rows-17-ragged-n"])
def test_triton_kernels_match_the_reference(scheme, shape):
    num_rows, in_features, out_features = shape
    linear = random_linear(out_features, in_features).to(DEVICE)
    layer = quant.QuantLinear(linear, scheme, quant_kernels.TritonQuantOps)
    x = torch.randn(num_rows, in_features, device=DEVICE)
    torch.testing.assert_close(layer(x), reference_out(x, layer), rtol=1e-4, atol=1e-4)


def test_quant_linear_keeps_the_leading_shape_and_the_bias():
    linear = torch.nn.Linear(64, 32)
    layer = quant.QuantLinear(linear, "int8", quant.ReferenceQuantOps)
    x = torch.randn(2, 3, 64)
    expected = F.linear(x, quant.dequantize_int8(layer.qweight, layer.scales), linear.bias)
    torch.testing.assert_close(layer(x), expected)


# ------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def fresh_embedded():
    """A copy of the embedded model per call: quantization swaps layers in place."""
    return lambda: load_model("smollm2", dtype="float32", device="cpu")


def engine_for(loaded, scheme, quant_ops=None, **config) -> LLMEngine:
    config.setdefault("device_memory_gb", 2.0)
    return assemble_engine(EngineConfig(quantization=scheme, **config), loaded=loaded,
                     quant_ops=quant_ops)


def test_int4_reference_gives_float32s_greedy_tokens(embedded, fresh_embedded):
    """The reference dequantizes every weight at every step (slow): two
    prompts, 8 tokens."""
    engine = engine_for(fresh_embedded(), "int4", quant.ReferenceQuantOps)
    prompts = {f"r{i}": apply_chat_template(embedded.tokenizer, m)
               for i, m in enumerate(PROMPTS[:2])}
    done = run_all(engine, prompts, greedy(8))
    for request_id, ids in prompts.items():
        assert done[request_id].token_ids == hf_greedy(embedded.model, ids, 8), request_id


def test_int8_engine_answers_and_the_card_holds_more_blocks(embedded, fresh_embedded):
    """On the 1.1 GiB demo card: the quantized weights are booked at their
    real size, and the bytes they free become KV blocks."""
    float_card = Card(torch.device("cpu"), 1.1)
    float_bytes = float_card.charge_weights(embedded.model)
    float_blocks, _ = num_blocks_for_card(float_card, embedded.model, 16, 512)

    engine = engine_for(fresh_embedded(), "int8", device_memory_gb=1.1)
    worker = engine.worker
    assert worker.weight_bytes == weight_bytes(engine.loaded.model) < float_bytes / 2
    assert worker.card.allocated_bytes() >= worker.weight_bytes
    assert engine.block_manager.num_blocks > float_blocks
    per_block = KVCache.bytes_per_block(embedded.model.config, 16, torch.float32)
    extra = (float_bytes - worker.weight_bytes) // per_block
    assert engine.block_manager.num_blocks - float_blocks == pytest.approx(extra, abs=1)

    prompt = apply_chat_template(embedded.tokenizer, PROMPTS[0])
    out = run_all(engine, {"q": prompt}, greedy(16))["q"]
    assert "Paris" in out.text  # still the model: it knows the capital of France


def test_quantization_is_refused_for_gpt2():
    loaded = load_model("tiny-gpt2", dtype="float32", device="cpu", load_format="dummy")
    with pytest.raises(ValueError, match="covers the Llama family"):
        engine_for(loaded, "int8")


def test_the_startup_log_names_the_weights(caplog, fresh_embedded):
    caplog.set_level("INFO", logger="llm-course")
    engine_for(fresh_embedded(), "int4", device_memory_gb=1.1)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("weights: ") and "(int4)" in line for line in lines), lines
    assert any(line.startswith("KV cache: ") and "blocks of 16 tokens" in line for line in lines)



# ------------------------------------------- --dtype auto, prefix caching
@pytest.mark.parametrize("native, model_dtype, expected", [
    (True, torch.bfloat16, torch.bfloat16),  # AMX / AVX512-BF16: the model's own
    (False, torch.bfloat16, torch.float32),  # emulated bfloat16 would be slower
    (True, torch.float32, torch.float32),  # a float32 model stays float32
    (True, None, torch.bfloat16),  # a config without a dtype counts as bfloat16
    (True, torch.float16, torch.bfloat16),  # CPUs have no fast float16 matmuls
])
def test_dtype_auto_follows_the_model_where_the_cpu_computes_it(monkeypatch, native,
                                                                  model_dtype, expected):
    from common import loader
    monkeypatch.setattr(loader, "cpu_computes_bfloat16", lambda: native)
    assert loader.pick_dtype("auto", torch.device("cpu"), model_dtype) == expected
    assert loader.pick_dtype("float32", torch.device("cpu"), torch.bfloat16) == torch.float32


def test_the_embedded_model_is_bfloat16_by_its_config():
    from common.loader import model_dtype
    assert model_dtype("smollm2") == torch.bfloat16
    assert model_dtype("tiny-llama", "dummy") is None


@pytest.mark.parametrize("chapter_default, argv, expected", [
    (False, [], False),  # chapter 04 teaches it: explicit
    (False, ["--enable-prefix-caching"], True),
    (True, [], True),  # chapters 05 and 06, as vLLM's engine
    (True, ["--no-enable-prefix-caching"], False),
])
def test_prefix_caching_defaults_per_chapter(chapter_default, argv, expected):
    from common.entrypoints.cli_args import server_parser
    args = server_parser("test", enable_prefix_caching=chapter_default).parse_args(argv)
    assert args.enable_prefix_caching is expected


@pytest.mark.parametrize("chapter, expected", [("04", False), ("05", True), ("06", True),
                                               ("07", True), ("08", True)])
def test_chapters_05_on_turn_prefix_caching_on(chapter, expected):
    from common.entrypoints.cli_args import api_server_parser, server_parser
    assert server_parser("test", chapter).parse_args([]).enable_prefix_caching is expected
    if chapter >= "06":
        assert api_server_parser("test", chapter).parse_args([]).enable_prefix_caching
