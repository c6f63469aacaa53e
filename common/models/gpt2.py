"""GPT-2's forward pass, written out (ch03): the model of the source material.

Learned position embeddings instead of rotary; LayerNorm; GELU (tanh
approximation); multi-head attention (as many K/V heads as query heads);
HF stores its projections as `Conv1D`, whose weight is (in, out): we
compute `x @ W + b`. The head is tied to the token embedding.

Left out: the `scale_attn_by_inverse_layer_idx` and `reorder_and_upcast_attn`
variants (off in every released GPT-2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.layers.attention import AttentionMetadata, paged_attention
from common.layers.attention_selector import attention_ops_for
from common.layers.logits import lm_head


def conv1d(x: torch.Tensor, layer) -> torch.Tensor:
    return torch.addmm(layer.bias, x, layer.weight)  # weight: (in, out)


class GPT2Forward:
    def __init__(self, hf_model, attention_ops=None):
        cfg = hf_model.config
        self.hf = hf_model
        self.attention_ops = attention_ops or attention_ops_for(hf_model.device)
        self.transformer = hf_model.transformer
        self.num_heads = cfg.n_head
        self.num_kv_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.eps = cfg.layer_norm_epsilon
        self.scale = self.head_dim ** -0.5
        self.packed_bytes = 0  # GPT-2 keeps its own products (Conv1D): none packed

    def release_plain_weights(self) -> None:
        """Nothing to free: GPT-2's products are not packed."""

    def layer_norm(self, x: torch.Tensor, ln) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), ln.weight, ln.bias, self.eps)

    def attention(self, block, x, k_cache, v_cache, meta: AttentionMetadata):
        num_tokens = x.shape[0]
        q, k, v = conv1d(x, block.attn.c_attn).split(x.shape[-1], dim=-1)
        shape = (num_tokens, self.num_heads, self.head_dim)
        out = paged_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape),
                              k_cache, v_cache, meta, self.scale,
                              self.attention_ops)  # (T, H, D)
        return conv1d(out.reshape(num_tokens, -1), block.attn.c_proj)

    def mlp(self, block, x):
        return conv1d(F.gelu(conv1d(x, block.mlp.c_fc), approximate="tanh"), block.mlp.c_proj)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (num_tokens,). Returns (num_tokens, hidden)."""
        t = self.transformer
        h = t.wte.weight[input_ids] + t.wpe.weight[positions]  # (T, hidden)
        for block, (k_cache, v_cache) in zip(t.h, kv_caches):
            h = h + self.attention(block, self.layer_norm(h, block.ln_1), k_cache, v_cache, meta)
            h = h + self.mlp(block, self.layer_norm(h, block.ln_2))
        return self.layer_norm(h, t.ln_f)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head(hidden, self.hf.lm_head.weight)  # (N, vocab)
