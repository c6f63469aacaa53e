"""Chapter 10: the Triton LoRA kernels (common/lora/triton_ops.py) agree with
the PyTorch reference, punica.add_lora_gathered.

Without a GPU the kernels run on CPU tensors under the Triton interpreter
(set below before common.lora.triton_ops is imported). The interpreter is
slow, so the shapes are small and the cases few; they still cover what can
go wrong: sizes that are not powers of two (masks), more than one tile of
inputs and of outputs, rows of slot -1, a batch on one adapter, one row, a
y that is a column slice of a fused output, float32, bfloat16 and float16.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="the LoRA kernels are written in Triton")

from tests.test_triton_kernels import ON_CUDA, use_triton_interpreter  # noqa: E402

if not ON_CUDA:
    use_triton_interpreter()  # before common.lora.triton_ops defines its kernels

from common.lora import punica, punica_wrapper  # noqa: E402
from common.lora import triton_ops  # noqa: E402
from common.lora.punica import NO_LORA  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
SLOTS = 3


def lora_stacks(d_in: int, d_out: int, rank: int, dtype: torch.dtype, seed: int = 0):
    """Random stacks (slots, r, in), (slots, out, r), (slots,), scaled so that
    a token's change is of the order of 1 (like y's base values)."""
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.randn(SLOTS, rank, d_in, generator=gen) / d_in ** 0.5
    lora_b = torch.randn(SLOTS, d_out, rank, generator=gen) / rank ** 0.5
    scaling = torch.tensor([0.5, 2.0, 1.0])  # each slot's alpha / r
    return [t.to(DEVICE, dtype) for t in (lora_a, lora_b, scaling)]


def mixed_indices(num_tokens: int, seed: int = 1) -> list[int]:
    """Every slot and -1, in no order (a step's tokens of several requests)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(NO_LORA, SLOTS, (num_tokens,), generator=gen)).tolist()


def check_against_reference(indices: list[int], d_in: int, d_out: int, rank: int,
                            dtype: torch.dtype = torch.float32, tol: float = 1e-5,
                            y_columns: slice | None = None) -> None:
    """add_lora_triton == add_lora_gathered (on float32 copies of the same
    numbers). y_columns: y is that column slice of a wider tensor, whose
    other columns must not change."""
    lora_a, lora_b, scaling = lora_stacks(d_in, d_out, rank, dtype)
    gen = torch.Generator().manual_seed(2)
    num_tokens = len(indices)
    x = torch.randn(num_tokens, d_in, generator=gen).to(DEVICE, dtype)
    columns = y_columns or slice(0, d_out)
    width = max(columns.stop + 5, d_out) if y_columns else d_out
    wide = torch.randn(num_tokens, width, generator=gen).to(DEVICE, dtype)
    y = wide[:, columns]  # a view: row stride `width`
    assert y.shape == (num_tokens, d_out)
    before = wide.clone()
    idx = torch.tensor(indices, device=DEVICE)

    expected = before[:, columns].float()
    punica.add_lora_gathered(expected, x.float(), lora_a.float(), lora_b.float(),
                             scaling.float(), idx)
    triton_ops.add_lora_triton(y, x, lora_a, lora_b, scaling, idx)

    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol)
    no_lora = idx == NO_LORA
    assert torch.equal(y[no_lora], before[:, columns][no_lora]), "a row of slot -1 changed"
    outside = torch.ones(width, dtype=torch.bool)
    outside[columns] = False
    assert torch.equal(wide[:, outside], before[:, outside]), "a column outside y changed"


# (in, out, rank): not powers of two; 576 in = 9 steps of the shrink's
# reduction, 192 out = 3 tiles of the expand, rank 64 = the largest one tile.
SHAPES = [pytest.param(96, 40, 8, id="in96-out40-r8"),
          pytest.param(576, 192, 16, id="in576-out192-r16"),
          pytest.param(48, 72, 64, id="in48-out72-r64"),
          pytest.param(33, 17, 5, id="in33-out17-r5")]


@pytest.mark.parametrize("d_in,d_out,rank", SHAPES)
def test_mixed_batch_matches_reference_float32(d_in, d_out, rank):
    """40 tokens of three adapters and of none, mixed."""
    check_against_reference(mixed_indices(40), d_in, d_out, rank)


@pytest.mark.parametrize("indices", [
    pytest.param([1] * 9, id="all-one-slot"),
    pytest.param([2], id="single-row"),
    pytest.param([NO_LORA], id="single-row-no-adapter"),
    pytest.param([NO_LORA] * 5, id="no-adapter-at-all"),
    pytest.param([0, NO_LORA, 0, 2, NO_LORA, 1], id="short-mixed"),
])
def test_batch_patterns_match_reference(indices):
    check_against_reference(indices, 96, 40, 8)


def test_adds_into_a_column_slice_of_a_fused_output():
    """q, k and v are column slices of one (T, q + k + v) product: y's row
    stride is the fused width, and the columns around it stay as they were."""
    check_against_reference(mixed_indices(17), 96, 40, 8, y_columns=slice(64, 104))
    check_against_reference(mixed_indices(17), 96, 40, 8, y_columns=slice(0, 40))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_inputs_accumulate_in_float32(dtype):
    """Held to the float32 reference on the same 16-bit numbers: only y's
    final rounding (bfloat16 keeps 8 bits) stands between them."""
    check_against_reference(mixed_indices(24), 96, 40, 8, dtype=dtype, tol=2e-2,
                            y_columns=slice(8, 48))


def test_shrink_alone_scales_and_zeroes_the_rows_without_adapter():
    lora_a, _, scaling = lora_stacks(96, 40, 8, torch.float32)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    idx = torch.tensor([0, NO_LORA, 2, 1, NO_LORA, 2], device=DEVICE)
    h = triton_ops.bgmv_shrink(x, lora_a, idx, scaling)
    assert h.shape == (6, 8) and h.dtype == torch.float32
    rows = idx != NO_LORA
    expected = punica.bgmv_shrink(x[rows], lora_a, idx[rows], scaling)
    torch.testing.assert_close(h[rows], expected, rtol=1e-5, atol=1e-5)
    assert bool((h[~rows] == 0).all())


def test_expand_alone_adds_in_place_and_leaves_the_rows_without_adapter():
    """Even where h is not zero (shrink writes zeros there), a row of slot -1
    keeps y's value: the expand never reads a slot for it."""
    _, lora_b, _ = lora_stacks(96, 40, 8, torch.float32)
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(5, 8, generator=gen).to(DEVICE)
    y = torch.randn(5, 40, generator=gen).to(DEVICE)
    before = y.clone()
    idx = torch.tensor([NO_LORA, 1, NO_LORA, 0, 2], device=DEVICE)
    triton_ops.bgmv_expand(h, lora_b, idx, y)
    rows = idx != NO_LORA
    expected = before[rows] + punica.bgmv_expand(h[rows], lora_b, idx[rows])
    torch.testing.assert_close(y[rows], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[~rows], before[~rows])


def test_wrapper_launches_nothing_without_adapters_and_matches_punica_wrapper(monkeypatch):
    """PunicaWrapperTriton answers the LoRA layers' two calls as
    punica_wrapper.PunicaWrapper does; a step with no adapter launches no kernel."""
    lora_a, lora_b, scaling = lora_stacks(96, 40, 8, torch.float32)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    base = torch.randn(7, 40, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    wrapper, reference = triton_ops.PunicaWrapperTriton(), punica_wrapper.PunicaWrapper(
        punica_wrapper.LoRAKernel.GROUPED)

    idx = torch.tensor([2, NO_LORA, 0, 0, 1, NO_LORA, 2], device=DEVICE)
    wrapper.update_metadata(idx)
    reference.update_metadata(idx)
    y, expected = base.clone(), base.clone()
    wrapper.add_lora_linear(y, x, lora_a, lora_b, scaling)
    reference.add_lora_linear(expected, x, lora_a, lora_b, scaling)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)

    monkeypatch.setattr(triton_ops, "add_lora_triton", lambda *args: pytest.fail("launched"))
    wrapper.update_metadata(torch.full((7,), NO_LORA, device=DEVICE))
    y = base.clone()
    wrapper.add_lora_linear(y, x, lora_a, lora_b, scaling)
    assert torch.equal(y, base)


# --- real sizes on a real GPU ------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rank", [8, 64])
def test_on_cuda_bfloat16_real_sizes(rank):
    """Llama-8B-like q_proj slice of a fused qkv output, a mixed batch."""
    check_against_reference(mixed_indices(300), 4096, 1024, rank, dtype=torch.bfloat16,
                            tol=3e-2, y_columns=slice(4096, 5120))
