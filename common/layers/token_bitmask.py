"""A grammar's token mask on the logits (ch07, structured outputs).

A grammar matcher (xgrammar's, common/structured_output/manager.py) says,
before each token, which tokens of the vocabulary may come next. It says
so as a *bitmask*: 32 tokens per int32 word, token t allowed when bit
t % 32 of word t // 32 is set:

    bitmask: (num_rows, ceil(vocab / 32)) int32
    token 70 -> word 2, bit 6 -> allowed iff (bitmask[row, 2] >> 6) & 1

Applying it sets every disallowed token's logit to -inf, before the
sampler: temperature, top-k/p and the softmax then only ever see allowed
tokens, and greedy picks the best allowed one. A penalty would not do:
a large enough logit would still win, and the JSON would break.

vLLM applies it with xgrammar's kernel (`xgr.apply_token_bitmask_inplace`,
CUDA or Triton on a GPU); this is the same operation in PyTorch, short
enough to read, and tests/test_structured_outputs.py checks it against
xgrammar's on random masks. It is exercise 07a's first task.

Left out: a fused kernel (this unpacks the bits into a (num_rows, vocab)
bool tensor first).
"""
from __future__ import annotations

import torch

BITS_PER_WORD = 32


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """(num_rows, ceil(vocab / 32)) int32, every bit set: every token
    allowed until a grammar fills its row (xgrammar's layout)."""
    return torch.full((num_rows, -(-vocab_size // BITS_PER_WORD)), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits: (num_rows, vocab), changed in place: tokens whose bit is 0 get
    -inf. bitmask: (num_rows, ceil(vocab / 32)) int32, on the logits' device.
    Words may cover more tokens than the logits have (the padding is ignored)."""
    num_rows, vocab = logits.shape
    bit = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)  # (32,)
    # (num_rows, words, 32): bit j of each word; the sign bit comes out as 1 too
    allowed = ((bitmask.unsqueeze(-1) >> bit) & 1).bool()
    allowed = allowed.reshape(num_rows, -1)[:, :vocab]  # (num_rows, vocab)
    logits.masked_fill_(~allowed, float("-inf"))
