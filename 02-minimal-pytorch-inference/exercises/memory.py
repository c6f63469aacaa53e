"""Exercise 02: what one request costs in KV cache.

Chapter 02's server reserves, for every request, a static KV cache of
`max_model_len` tokens, whatever the prompt's length. Two such reservations
do not fit the 1.1 GiB demo card: that is the out-of-memory crash. You write
the arithmetic behind it, the three functions the server and the card use:

1. `kv_cache_shape`: (layers, KV heads, head dim) read from a Hugging Face
   config, whatever the family calls them (Llama names, GPT-2 names).
2. `kv_bytes_per_token`: the bytes of K and V one token costs, all layers.
3. `static_cache_bytes`: what one request reserves: `max_model_len` tokens.

Graded by `make exercise CH=02` (the tests marked `ex02` in
tests/test_ch02_naive.py): the embedded model's 45 KiB per token, the three
config namings, and "the demo card holds one request but not two".

exercises/README.md has the hints; a failing test names the hint to
read first. Once every test passes, compare your functions with
common/memory.py, the ones the server and the card use.

Left out on purpose, although common/memory.py has them: activations
(estimated by `activation_bytes_estimate`), the weights
(`Card.charge_weights`), the card itself (`Card`: the budget and the
out-of-memory error). This exercise is the KV cache's arithmetic; the
card around it is given. Left out of both: quantized caches.
"""
from __future__ import annotations

import torch


def kv_cache_shape(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a Hugging Face model config.

    config: a `transformers` config (`LlamaConfig`, `Qwen2Config`,
        `GPT2Config`, ...). The names differ by family:

        what          Llama / Qwen2 name       GPT-2 name
        layers        num_hidden_layers        n_layer
        query heads   num_attention_heads      n_head
        KV heads      num_key_value_heads      (none: as many as query heads)
        hidden size   hidden_size              n_embd
        head dim      head_dim (may be absent or None)

    With grouped-query attention (GQA) there are fewer KV heads than query
    heads (SmolLM2: 9 query heads share 3 KV heads); only the KV heads are
    cached. Without a stated head_dim, head_dim = hidden_size / query heads.

    Returns three ints, e.g. (30, 3, 64) for SmolLM2-135M.
    """
    # Stuck? exercises/README.md, hints 1 to 3.
    raise NotImplementedError(
        "kv_cache_shape: read layers, KV heads and head_dim from the config "
        "(Llama names or GPT-2 names; KV heads default to the query heads)")


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V that one token costs in the cache, over all layers.

    2 (K and V) x layers x KV heads x head_dim x bytes per element.

    dtype: the cache's element type (torch.float32: 4 bytes, torch.bfloat16
        and torch.float16: 2 bytes).
    Returns an int: 46080 (45 KiB) for SmolLM2-135M in float32.
    """
    # Stuck? exercises/README.md, hint 4.
    raise NotImplementedError(
        "kv_bytes_per_token: 2 x layers x kv_heads x head_dim x bytes per element")


def static_cache_bytes(config, dtype: torch.dtype, max_model_len: int) -> int:
    """What chapter 02 reserves for every request: a static cache of
    `max_model_len` tokens (the worst case), whatever the prompt's length.

    Returns an int: 46080 x 8192 = 360 MiB for SmolLM2-135M in float32.
    """
    raise NotImplementedError(
        "static_cache_bytes: the bytes per token times max_model_len")
