"""Exercise 10a: the LoRA products of a batch that mixes adapters.

With `--enable-lora`, one step's batch holds tokens of sequences that run
different adapters, or none. Every projection of the model (q/k/v, o,
gate/up, down) still runs once for the whole batch with its base weight;
then each token adds its own adapter's low-rank change:

    y_t += scaling_s * B_s (A_s x_t)       s: token t's slot, -1 = none

The engine keeps the adapters of the step in `max_loras` slots, stacked
per projection (common/lora/layers.py's `LoRASlots`):

    lora_a:  (slots, r, in)     A of each slot: in -> r (shrink)
    lora_b:  (slots, out, r)    B of each slot: r -> out (expand)
    scaling: (slots,)           each slot's lora_alpha / r
    indices: (T,) int64         each token's slot, or NO_LORA (-1)

r is `--max-lora-rank`: an adapter of a smaller rank is padded with
zeros (the extra rows of A and columns of B add nothing). A free slot is
all zeros.

You write vLLM's gathered form (its `bgmv_shrink` and `bgmv_expand`
kernels: "batched gather matrix-vector"), where each row picks its own A
and B out of the stack, then the function that adds it to the base
product, and the step's mapping that the grouped form uses:

1. `bgmv_shrink`: each row times its own A, scaled by its slot's
   alpha / r: (T, in) -> (T, r);
2. `bgmv_expand`: each row times its own B: (T, r) -> (T, out);
3. `add_lora_gathered`: the two on the rows that have an adapter, added
   into `y` in place; the rows without one are left alone;
4. `LoRAMapping.from_indices`: each slot in use and its rows, for the
   grouped product (common/lora/punica.py's `add_lora_grouped`).

Graded by `make exercise CH=10a` (the tests marked `ex10a` in
tests/test_ch10_lora_products_exercise.py: your functions against a
per-row loop over merged weights W + scaling * B A, in float32 and
bfloat16, then in the engine, where every LoRA layer of the embedded
model calls them and each adapter's greedy tokens must be HF's on peft's
merged model). exercises/README.md has the tasks and the hints; a
failing test names the hint to read first. Once every test passes,
compare with common/lora/punica.py.

Given: `NO_LORA`, the dataclass `LoRAMapping` (you write its
`from_indices`). Left out on purpose, although the course has them: the
grouped product `add_lora_grouped` (one slot at a time: two small
products per adapter, no copy of the weights), and, in
common/lora/punica_wrapper.py, the stacked form the engine runs on the
CPU (`add_lora_stacked`: every slot at once, two products for the batch)
and `PunicaWrapper`, which holds the step's mapping for every layer.
Left out of both: vLLM's fused Triton and CUDA kernels, LoRA on the
embedding and the LM head.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

NO_LORA = -1  # a token of a sequence that runs the base model alone


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor,
                scaling: torch.Tensor) -> torch.Tensor:
    """Each row through its own adapter's A, scaled by its alpha / r.

    x:        (T, in)          the projection's input, one row per token
    lora_a:   (slots, r, in)   every slot's A
    indices:  (T,) int64       row t's slot; here every one is a slot
                               (0 <= indices[t] < slots): no NO_LORA
    scaling:  (slots,)         every slot's alpha / r
    returns:  (T, r)           row t: scaling[s] * A_s @ x[t], s = indices[t]

    Everything in the model's dtype (float32 or bfloat16): x, the stacks
    and the result alike. Do not change x or the stacks.
    """
    # Stuck? exercises/README.md, hints 1 and 3.
    raise NotImplementedError("bgmv_shrink: gather each row's A (T, r, in), multiply "
                              "each row by its own, scale by its slot's alpha / r")


def bgmv_expand(h: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Each row through its own adapter's B.

    h:        (T, r)           what `bgmv_shrink` returned
    lora_b:   (slots, out, r)  every slot's B
    indices:  (T,) int64       row t's slot, every one a slot
    returns:  (T, out)         row t: B_s @ h[t], s = indices[t]
    """
    # Stuck? exercises/README.md, hints 1 and 2.
    raise NotImplementedError("bgmv_expand: gather each row's B (T, out, r) and "
                              "multiply each row by its own")


def add_lora_gathered(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                      lora_b: torch.Tensor, scaling: torch.Tensor,
                      indices: torch.Tensor) -> None:
    """Add each row's adapter change to the base product, in place.

    y:        (T, out)   the base product x @ W^T, changed in place: it may
                         be a view into a larger tensor (the q, k and v
                         outputs are slices of one fused product)
    x:        (T, in)    the projection's input
    lora_a, lora_b, scaling: the stacks, as in `bgmv_shrink` and `bgmv_expand`
    indices:  (T,) int64 each row's slot, or NO_LORA (-1): that row runs
                         the base model alone and its y must not change

    Afterwards y[t] = base[t] + scaling[s] * B_s @ (A_s @ x[t]) for every
    row t with a slot s, and y[t] = base[t] for every row with NO_LORA.
    Returns None, as an in-place operation does.
    """
    # Stuck? exercises/README.md, hints 2, 4 and 5.
    raise NotImplementedError("add_lora_gathered: the rows with a slot, shrink then "
                              "expand, added back at those rows of y in place")


@dataclass
class LoRAMapping:
    """One step's tokens and their slots, in the two forms the products use."""
    token_lora_indices: torch.Tensor  # (T,) int64, a slot or NO_LORA
    # the grouped form: each slot in use, and its rows (R_s,) int64
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def from_indices(cls, indices: torch.Tensor) -> "LoRAMapping":
        """The mapping of a step whose tokens have these slots.

        indices:  (T,) int64, each a slot or NO_LORA, e.g. [0, 2, -1, 2]
        returns:  LoRAMapping(token_lora_indices=indices, groups=...) where
                  groups holds one (slot, rows) pair per slot in use: slot a
                  Python int, rows the (R_s,) int64 tensor of the rows of
                  that slot, in increasing order, on indices' device.
                  Here: [(0, tensor([0])), (2, tensor([1, 3]))], in any
                  order of slots. No group for NO_LORA; none at all when
                  no row has a slot.
        """
        # Stuck? exercises/README.md, hint 7.
        raise NotImplementedError("LoRAMapping.from_indices: one (slot, rows) group per "
                                  "slot in use, none for NO_LORA")
