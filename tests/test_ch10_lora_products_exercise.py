"""Exercise 10a's grading tests: the LoRA products of a mixed batch
(`make exercise CH=10a`; the reference is `bgmv_shrink`, `bgmv_expand`,
`add_lora_gathered` and `LoRAMapping.from_indices` in common/lora/punica.py).

The truth is a per-row loop in float64 over merged weights: row t of
slot s gets x_t @ (scaling_s * B_s A_s)^T, the change peft's
`merge_and_unload` folds into the base weight. The stacks are random,
each slot with its own rank (padded with zeros to the largest) and its
own alpha / r, none of them 1; the batches mix slots and rows without
an adapter (NO_LORA, -1) in every order, or give the whole batch one
adapter. The last test puts your functions in every LoRA layer of the
embedded model, through the real engine, with two seeded random peft
adapters.

Each test is built to catch a mistake learners make: one adapter for
every row, the scale forgotten or taken from the wrong slot, A and B
swapped with the shapes mended by transposes (a square projection, as
q_proj and o_proj are in SmolLM2, lets it run), the rows without an
adapter given the last slot's (index -1 wraps round), the change added
at the wrong rows, a result assigned instead of added in place,
bfloat16 mixed with float32, NO_LORA grouped as if it were a slot.
"""
from __future__ import annotations

import pytest
import torch

from common.lora.punica import NO_LORA, add_lora_grouped
from tests.adapters import lora_engine, peft_adapter

pytestmark = pytest.mark.ex10a

SCALINGS = (2.0, 0.5, 4.0, 0.25)  # alpha / r of slots 0..3: none of them 1
SQUARE, WIDE, NARROW = (32, 32), (32, 48), (48, 24)  # (in, out)


def lora_stacks(ranks=(4, 8, 2), d_in=32, d_out=48, dtype=torch.float32, seed=0):
    """Stacked slots as common/lora/layers.py's LoRASlots holds them: A
    (slots, r, in), B (slots, out, r), r the largest rank; a smaller rank
    padded with zeros. Returns lora_a, lora_b, scaling."""
    gen = torch.Generator().manual_seed(seed)
    max_rank = max(ranks)
    lora_a = torch.zeros(len(ranks), max_rank, d_in)
    lora_b = torch.zeros(len(ranks), d_out, max_rank)
    for slot, rank in enumerate(ranks):
        lora_a[slot, :rank] = torch.randn(rank, d_in, generator=gen) / d_in ** 0.5
        lora_b[slot, :, :rank] = torch.randn(d_out, rank, generator=gen)
    scaling = torch.tensor(SCALINGS[:len(ranks)])
    return lora_a.to(dtype), lora_b.to(dtype), scaling.to(dtype)


def batch(num_rows: int, d_in: int, d_out: int, dtype=torch.float32, seed=1):
    """x (T, in) and a base product y (T, out)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, d_in, generator=gen).to(dtype),
            torch.randn(num_rows, d_out, generator=gen).to(dtype))


def merged_rows(base, x, lora_a, lora_b, scaling, indices) -> torch.Tensor:
    """The truth, row by row in float64: base[t] + x[t] @ (s B A)^T for row
    t's slot s, base[t] alone for a row without one."""
    out = base.double().clone()
    for t, slot in enumerate(indices.tolist()):
        if slot != NO_LORA:
            delta = scaling[slot].double() * (lora_b[slot].double() @ lora_a[slot].double())
            out[t] += x[t].double() @ delta.T  # delta: (out, in), as a weight
    return out


def added(impl, indices, ranks=(4, 8, 2), shape=WIDE, dtype=torch.float32, seed=0):
    """Run the learner's add_lora_gathered on a fresh batch: (y after,
    the float64 truth, the base before)."""
    lora_a, lora_b, scaling = lora_stacks(ranks, *shape, dtype=dtype, seed=seed)
    idx = torch.tensor(indices, dtype=torch.long)
    x, base = batch(len(indices), *shape, dtype=dtype, seed=seed + 1)
    y = base.clone()
    impl.add_lora_gathered(y, x, lora_a, lora_b, scaling, idx)
    return y, merged_rows(base, x, lora_a, lora_b, scaling, idx), base


def close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{what}:\n{m}")


# ------------------------------------------------ 1. shrink and expand
def test_bgmv_shrink_gives_each_row_its_own_a(impl):
    """(T, in) -> (T, r): row t times the A of its own slot. The scales
    are all 1 here, so only the choice of A counts; 5 rows over 3 slots
    in a mixed order, and the whole batch on slot 1."""
    lora_a, _, _ = lora_stacks(d_in=32, d_out=48)
    ones = torch.ones(3)
    x, _ = batch(5, 32, 48)
    for indices in ([2, 0, 1, 0, 2], [1] * 5):
        idx = torch.tensor(indices)
        h = impl.bgmv_shrink(x, lora_a, idx, ones)
        assert h.shape == (5, lora_a.shape[1]), f"(T, r) = (5, 8), not {tuple(h.shape)}"
        expected = torch.stack([lora_a[s].double() @ x[t].double()
                                for t, s in enumerate(indices)])
        close(h, expected, f"bgmv_shrink with slots {indices} (scales 1)")


def test_bgmv_shrink_scales_each_row_by_its_own_adapters_alpha_over_r(impl):
    """The same, with the slots' scales 2, 0.5 and 4: row t's result is
    scaling[s] times A_s x_t, the scale of its own slot, not one scale
    for the batch and not none."""
    lora_a, _, scaling = lora_stacks(d_in=32, d_out=48)
    x, _ = batch(6, 32, 48)
    indices = [2, 0, 1, 1, 0, 2]
    h = impl.bgmv_shrink(x, lora_a, torch.tensor(indices), scaling)
    expected = torch.stack([scaling[s].double() * (lora_a[s].double() @ x[t].double())
                            for t, s in enumerate(indices)])
    close(h, expected, f"bgmv_shrink with slots {indices} and scales {scaling.tolist()}")


def test_bgmv_expand_gives_each_row_its_own_b(impl):
    """(T, r) -> (T, out): row t times the B of its own slot."""
    _, lora_b, _ = lora_stacks(d_in=32, d_out=48)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(5, lora_b.shape[2], generator=gen)
    for indices in ([1, 2, 0, 2, 1], [0] * 5):
        out = impl.bgmv_expand(h, lora_b, torch.tensor(indices))
        assert out.shape == (5, 48), f"(T, out) = (5, 48), not {tuple(out.shape)}"
        expected = torch.stack([lora_b[s].double() @ h[t].double()
                                for t, s in enumerate(indices)])
        close(out, expected, f"bgmv_expand with slots {indices}")


# ------------------------------------------------ 2. the whole change
def test_the_change_is_added_in_place_to_a_view(impl):
    """y is changed in place, and may be a view: the engine's q, k and v
    outputs are column slices of one fused product (common/lora/layers.py's
    MergedLinearWithLoRA), and what the next layer reads is the fused
    tensor. Your function on a slice of it must change the slice as it
    changes a tensor of its own, and leave the other columns alone. (A
    square projection, 32 to 32: only where y goes is checked here.)"""
    lora_a, lora_b, scaling = lora_stacks(d_in=32, d_out=32)
    indices = torch.tensor([0, NO_LORA, 2, 1, 2])
    x, _ = batch(5, 32, 32)
    fused = torch.randn(5, 8 + 32 + 8, generator=torch.Generator().manual_seed(5))
    before = fused.clone()
    own = before[:, 8:40].clone()  # (5, 32), a tensor of its own
    impl.add_lora_gathered(own, x, lora_a, lora_b, scaling, indices)
    assert not torch.equal(own, before[:, 8:40]), (
        "y did not change: add into y in place (+=, index_add_, y[rows] += ...), "
        "do not bind the name y to a new tensor")
    impl.add_lora_gathered(fused[:, 8:40], x, lora_a, lora_b, scaling, indices)  # a view
    torch.testing.assert_close(fused[:, 8:40], own,
                               msg=lambda m: f"on a view, y did not change as on a tensor:\n{m}")
    assert torch.equal(fused[:, :8], before[:, :8]) and torch.equal(fused[:, 40:], before[:, 40:])


@pytest.mark.parametrize("shape", [SQUARE, WIDE, NARROW], ids=["square", "wide", "narrow"])
def test_the_change_is_x_times_the_merged_weight_transposed(impl, shape):
    """The whole batch on one adapter: y = base + x @ (s B A)^T, the
    merged weight's change, (out, in) like a weight. A square projection
    (in = out, as q_proj and o_proj in SmolLM2) first: there A and B
    swapped, with transposes to make the shapes fit, still run."""
    y, expected, _ = added(impl, [1] * 6, shape=shape)
    close(y, expected, f"one adapter for 6 rows, (in, out) = {shape}")


def test_rows_without_an_adapter_are_left_alone(impl):
    """Rows of NO_LORA (-1) keep their base product, bit for bit; the
    others get their own slot's change, at their own row. The -1 rows
    come first, in the middle and last, and slot 2 (the last) is in use
    elsewhere: `lora_a[-1]` is slot 2's A."""
    indices = [NO_LORA, 0, NO_LORA, NO_LORA, 1, 0, NO_LORA]
    y, expected, base = added(impl, indices)
    for t, slot in enumerate(indices):
        if slot == NO_LORA:
            assert torch.equal(y[t], base[t]), f"row {t} has no adapter, and it changed"
    close(y, expected, f"slots {indices}")
    y, _, base = added(impl, [NO_LORA] * 4)
    assert torch.equal(y, base), "no row has an adapter, and y changed"


@pytest.mark.parametrize("indices", [
    [0, 2, NO_LORA, 2, 1, 0, NO_LORA, 1],  # every slot, mixed
    [NO_LORA, 2, 2, 2],                    # one adapter beside the base model
    [1],                                   # a single row (a decode step)
    [2, 1, 0],                             # every row its own slot
], ids=["mixed", "one-beside-base", "one-row", "all-different"])
def test_a_mixed_batch_equals_the_per_row_loop(impl, indices):
    """Any mix of slots and NO_LORA: each row as the loop over merged
    weights gives it. Slots of ranks 4, 8 and 2 in one stack of rank 8:
    the padding adds nothing."""
    y, expected, _ = added(impl, indices)
    close(y, expected, f"slots {indices}")


def test_the_inputs_are_not_changed(impl):
    """x and the stacks belong to the model: read them, never write them."""
    lora_a, lora_b, scaling = lora_stacks()
    x, base = batch(4, 32, 48)
    copies = [t.clone() for t in (x, lora_a, lora_b, scaling)]
    impl.add_lora_gathered(base, x, lora_a, lora_b, scaling, torch.tensor([2, NO_LORA, 0, 1]))
    for name, tensor, copy in zip(("x", "lora_a", "lora_b", "scaling"),
                                  (x, lora_a, lora_b, scaling), copies):
        assert torch.equal(tensor, copy), f"{name} was changed"


def test_bfloat16_stays_bfloat16_within_its_precision(impl):
    """The model in bfloat16 (`--dtype bfloat16`): x, the stacks, the
    scales and y all bfloat16. y stays bfloat16, and each value is within
    bfloat16's precision of the float64 truth (3 % of the largest)."""
    indices = [0, NO_LORA, 2, 1, 2, NO_LORA]
    y, expected, base = added(impl, indices, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    scale = expected.abs().max().item()
    torch.testing.assert_close(y.double(), expected, rtol=0.03, atol=0.03 * scale)
    assert torch.equal(y[1], base[1]) and torch.equal(y[5], base[5])


# ------------------------------------------------ 3. the grouped form
def test_the_mapping_groups_each_slot_with_its_rows(impl):
    """One (slot, rows) group per slot in use, rows int64 in increasing
    order; no group for NO_LORA; the indices kept as given."""
    idx = torch.tensor([0, 2, NO_LORA, 2, 1, NO_LORA, 0, 2])
    mapping = impl.LoRAMapping.from_indices(idx)
    assert torch.equal(mapping.token_lora_indices, idx)
    slots = [slot for slot, _ in mapping.groups]
    assert sorted(slots) == [0, 1, 2], f"one group per slot in use: {slots}"
    rows = {int(slot): rows for slot, rows in mapping.groups}
    for slot, expected in {0: [0, 6], 1: [4], 2: [1, 3, 7]}.items():
        assert rows[slot].dtype == torch.int64 and rows[slot].dim() == 1
        assert rows[slot].tolist() == expected, f"slot {slot}: rows {rows[slot].tolist()}"
    assert impl.LoRAMapping.from_indices(torch.tensor([NO_LORA] * 3)).groups == [], (
        "no row has an adapter: no group at all")


def test_the_grouped_product_with_your_mapping_equals_the_loop(impl):
    """The course's grouped product (a slot in use at a time), driven by
    your mapping: each slot's rows get that slot's change."""
    lora_a, lora_b, scaling = lora_stacks()
    indices = torch.tensor([1, NO_LORA, 0, 1, 2, NO_LORA, 2])
    x, base = batch(7, 32, 48)
    y = base.clone()
    add_lora_grouped(y, x, lora_a, lora_b, scaling, impl.LoRAMapping.from_indices(indices))
    close(y, merged_rows(base, x, lora_a, lora_b, scaling, indices), "the grouped product")


# ------------------------------------------------ 4. in the engine
def test_the_engine_with_your_products_gives_each_adapter_peft_merged_tokens(embedded, tmp_path,
                                                                            impl):
    """The embedded model (float32) and two seeded random peft adapters
    (rank 8 on every projection, alpha / r = 2; rank 4, padded to 8, on
    q, v and down only, alpha / r = 4), both in slots: one batch of the
    base model and each adapter,
    through your functions in all 210 LoRA layers. Each request's 12
    greedy tokens equal HF `generate` on the base model or on peft's
    merged model."""
    from common.loader import apply_chat_template
    from common.lora.request import LoRARequest
    from tests.conftest import PROMPTS, hf_greedy
    from tests.engine_helpers import greedy, run_all
    merged = {1: peft_adapter(embedded.model, tmp_path / "a1", 8, 16, seed=1),
              2: peft_adapter(embedded.model, tmp_path / "a2", 4, 16, seed=2,
                              targets=("q_proj", "v_proj", "down_proj"))}
    prompts = [apply_chat_template(embedded.tokenizer, PROMPTS[i]) for i in range(3)]
    requests = {"base-0": (0, 0), "a1-1": (1, 1), "a2-2": (2, 2), "base-1": (1, 0)}
    engine = lora_engine(embedded, impl, max_loras=2, max_lora_rank=8)
    for name, (p, lora) in requests.items():
        adapter = LoRARequest(f"a{lora}", lora, str(tmp_path / f"a{lora}")) if lora else None
        engine.add_request(name, prompts[p], greedy(12), lora_request=adapter)
    got = {name: out.token_ids for name, out in run_all(engine).items()}
    expected = {name: hf_greedy(merged.get(lora, embedded.model), prompts[p], 12)
                for name, (p, lora) in requests.items()}
    assert expected["a1-1"] != expected["base-1"], "adapter 1 changes nothing"
    assert got == expected
