"""The KV cache tensors and how many blocks the card can hold (ch03).

One (K, V) pair of tensors per layer, each of shape `(num_blocks,
block_size, num_kv_heads, head_dim)`, allocated through the card. Their
size comes from the card, as in vLLM: budget - weights - peak activations
(measured by a warm-up forward pass on CUDA, estimated on the CPU), divided
by the bytes of one block.

Chapter 03 calls a block of `max_model_len` slots a *region*: each sequence
reserves one whole region when it starts (the classic pre-allocation), and
requests that find no free region wait. Chapter 04 cuts the same memory into
blocks of 16 slots handed out on demand (common/core/block_manager.py).

ch08, tensor parallelism: each rank holds its KV heads only
(num_kv_heads / N), so one block costs 1/N of the bytes on each of N cards;
the ranks agree on one number of blocks (the smallest), since the
scheduler hands out each block on all of them at once.

Left out: CPU swap space, per-layer cache sizes (sliding windows), FP8.
"""
from __future__ import annotations

import torch

from common.memory import (
    Card,
    activation_bytes_estimate,
    format_bytes,
    kv_bytes_per_token,
    kv_cache_shape,
)


@torch.no_grad()
def measure_activation_bytes(hf_model, num_tokens: int, card: Card,
                             tensor_parallel_size: int = 1) -> int:
    """Peak memory of one forward pass over `num_tokens` tokens (the warm-up)."""
    dtype = next(hf_model.parameters()).dtype
    # The CPU allocator keeps no peak statistics; HF's forward cannot run a
    # shard (ch08), so a rank's activations are estimated too.
    if card.simulated or tensor_parallel_size > 1:
        return activation_bytes_estimate(hf_model.config, num_tokens, dtype,
                                         tensor_parallel_size)
    device = card.device
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)
    hf_model(ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    # Hand the warm-up's cached blocks back to the card (vLLM does the same
    # after its profile run): on a capped card (--device-memory-gb) the cap
    # counts them, and the KV cache's layers would not fit beside them.
    torch.cuda.empty_cache()
    return peak


class KVCache:
    def __init__(self, card: Card, config, num_blocks: int, block_size: int,
                 dtype: torch.dtype, tensor_parallel_size: int = 1):
        self.num_layers, num_kv_heads, self.head_dim = kv_cache_shape(config)
        self.num_kv_heads = num_kv_heads // tensor_parallel_size  # ch08: this rank's heads
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        # kv_caches[layer] = (k_cache, v_cache), each (num_blocks, block_size, H_kv, D)
        self.tensors = [card.allocate(shape, dtype, f"KV cache layer {i}")
                        for i in range(self.num_layers)]
        self.kv_caches = [(t[0], t[1]) for t in self.tensors]

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype,
                        tensor_parallel_size: int = 1) -> int:
        """On one rank: 1/N of the whole block's bytes (ch08)."""
        return kv_bytes_per_token(config, dtype) // tensor_parallel_size * block_size


def num_blocks_for_card(card: Card, hf_model, block_size: int, max_num_batched_tokens: int,
                        tensor_parallel_size: int = 1) -> tuple[int, str]:
    """How many blocks fit: (budget - weights - activations) / block bytes.
    Returns the number and a line that explains it. ch08: on one rank's card."""
    dtype = next(hf_model.parameters()).dtype
    activations = measure_activation_bytes(hf_model, max_num_batched_tokens, card,
                                           tensor_parallel_size)
    per_block = KVCache.bytes_per_block(hf_model.config, block_size, dtype,
                                        tensor_parallel_size)
    available = card.free_bytes() - activations
    num_blocks = max(0, available // per_block)
    line = (f"KV cache: {card.describe()}; activations {format_bytes(activations)}; "
            f"{format_bytes(max(0, available))} left = {num_blocks} blocks of "
            f"{block_size} tokens ({format_bytes(per_block)} each)")
    if num_blocks < 1:
        raise torch.OutOfMemoryError(
            f"the card has no room for one KV block of {block_size} tokens "
            f"({format_bytes(per_block)}): {line}. Use a bigger --device-memory-gb, "
            "a smaller --max-model-len or --block-size.")
    return int(num_blocks), line
