"""Exercise 07a: a grammar's token mask on the logits (structured outputs).

You write the one line of tensor work that makes `response_format`
hold: before the sampler, every token the grammar does not allow at this
position gets a logit of -inf. Temperature, top-k/p and the softmax then
only ever see allowed tokens, and greedy picks the best allowed one.

The grammar matcher (xgrammar's, common/structured_output/manager.py)
says which tokens are allowed as a *bitmask*, 32 tokens per int32 word:

    bitmask: (num_rows, ceil(vocab / 32)) int32
    token t allowed  <=>  bit t % 32 of word t // 32 is 1
    token 70 -> word 2, bit 6 -> allowed iff (bitmask[row, 2] >> 6) & 1

Row i of the bitmask belongs to row i of the logits (one row per
constrained sequence, or with speculative decoding one per position
checked). The engine's grammar step calls `apply_token_bitmask(logits,
bitmask)` on the rows of the step's constrained sequences
(`StructuredOutputManager.apply` in common/structured_output/manager.py,
a logits processor of the model runner), then samples as usual.

Graded by `make exercise CH=07a` (the tests marked `ex07a` in
tests/test_structured_outputs.py, which call your function: against
xgrammar's own `apply_token_bitmask_inplace` on random masks, float32
and bfloat16, vocabularies of 49,152, 100 and 33 tokens; then in a plain
generation loop of the embedded model, where every sampled answer must
validate against its JSON schema). exercises/README.md has the tasks
and the hints; a failing test names the hint to read first. Once every
test passes, compare your function with common/layers/token_bitmask.py,
the one the engine runs.

Given: `allocate_token_bitmask` (every bit set: every token allowed).
Left out, as in the course's function: a fused kernel (vLLM calls
xgrammar's CUDA or Triton one; this works in plain PyTorch on any
device). Nothing else: the course's module is these two functions, and
the grammar that fills the bitmask (xgrammar's matcher, driven by
common/structured_output/manager.py) is given.
"""
from __future__ import annotations

import torch

BITS_PER_WORD = 32


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """(num_rows, ceil(vocab / 32)) int32, every bit set (-1 is 32 ones in
    two's complement): every token allowed until a grammar fills its row.
    xgrammar's `xgr.allocate_token_bitmask` makes the same tensor."""
    return torch.full((num_rows, -(-vocab_size // BITS_PER_WORD)), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask the logits in place; returns nothing.

    logits:  (num_rows, vocab) float (float32, bfloat16...), changed in
             place: every token whose bit is 0 gets float("-inf"); the
             allowed tokens keep their logit exactly.
    bitmask: (num_rows, ceil(vocab / 32)) int32, on the logits' device.
             The last word may cover tokens past `vocab` (when vocab is not
             a multiple of 32): ignore those bits.
    """
    # No Python loop over the tokens: unpack every word at once.
    # Stuck? exercises/README.md, hints 1 to 4.
    raise NotImplementedError("apply_token_bitmask: set the logit of every token whose bit "
                              "is 0 to -inf, in place")
