"""The Llama family's forward pass, written out (ch03): SmolLM2, Llama,
Qwen2 (q/k/v biases) and Mistral.

Per layer: RMSNorm -> q, k, v projections -> rotary embeddings -> attention
through the paged KV cache (common/layers/attention.py) -> output projection ->
residual; RMSNorm -> SwiGLU MLP -> residual. Grouped-query attention: fewer
K/V heads than query heads, so the cache is smaller.

The weights are the HF model's own tensors (no copy). The input is a flat
batch of tokens from any number of sequences, prefill or decode alike:
`input_ids` and `positions` of shape (num_tokens,), plus AttentionMetadata.

Tensor parallelism (ch08, common/layers/parallel.py): `shard_llama_for_rank`
cuts each matrix; given a `TPGroup` of N ranks, the weights are this rank's shard, so each rank runs num_heads/N
query heads and num_kv_heads/N KV heads, 1/N of the MLP and of the
vocabulary; o_proj, down_proj and the embedding end with an all-reduce, the
LM head with a gather on rank 0. With one rank nothing of that runs.

ch05: q/k/v and gate/up are each one matrix product (common/layers/fused.py,
as vLLM's QKVParallelLinear and MergedColumnParallelLinear), except for
quantized layers (ch08), which keep one product per projection. On a CPU
every product multiplies by a weight packed once for oneDNN
(common/layers/cpu_gemm.py); a served engine then frees the plain ones
(`release_plain_weights`).

Left out: Mistral's sliding window (attention sees the whole context).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.layers.attention import AttentionMetadata, paged_attention
from common.layers.attention_selector import attention_ops_for
from common.layers.cpu_gemm import Gemm, PackedLinear, gemm_for, packed_bytes, release_plain_weight
from common.layers.elementwise import elementwise_ops_for
from common.layers.fused import FusedLinear, fuse_linears
from common.layers.logits import lm_head_gemm
from common.layers.parallel import (
    SINGLE_RANK,
    TPGroup,
    shard_input_features,
    shard_output_features,
    vocab_parallel_embedding,
    vocab_shard,
)


def linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """nn.Linear (bias: Qwen2's q/k/v only), or a QuantLinear (ch06:
    common/layers/quantization.py) that multiplies by its quantized weight."""
    if isinstance(layer, torch.nn.Linear):
        return F.linear(x, layer.weight, layer.bias)
    return layer(x)  # ch08: --quantization


class LlamaForward:
    def __init__(self, hf_model, attention_ops=None, tp: TPGroup = SINGLE_RANK):
        cfg = hf_model.config
        self.hf = hf_model
        self.attention_ops = attention_ops or attention_ops_for(hf_model.device)
        self.layers = hf_model.model.layers
        self.tp = tp
        self.vocab_size = cfg.vocab_size
        self.num_heads = cfg.num_attention_heads // tp.world_size  # ch08: this rank's heads
        self.num_kv_heads = cfg.num_key_value_heads // tp.world_size  # ch08
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.act = F.silu if cfg.hidden_act == "silu" else getattr(F, cfg.hidden_act)
        # HF computed the inverse frequencies with the model's theta and its
        # rope scaling (llama3, linear, yarn...); we reuse them.
        rotary = hf_model.model.rotary_emb
        self.inv_freq = rotary.inv_freq  # (head_dim / 2,)
        self.attention_scaling = getattr(rotary, "attention_scaling", 1.0)
        # ch05: one product for q/k/v and one for gate/up (None: quantized, one each)
        self.qkv: list[FusedLinear | None] = [
            fuse_linears([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
            for layer in self.layers]
        self.gate_up: list[FusedLinear | None] = [
            fuse_linears([layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in self.layers]
        # ch05: the other products, packed on a CPU (cpu_gemm.py)
        self.o_proj: list[Gemm] = [gemm_for(layer.self_attn.o_proj) for layer in self.layers]
        self.down_proj: list[Gemm] = [gemm_for(layer.mlp.down_proj) for layer in self.layers]
        head, embedding = hf_model.lm_head.weight, hf_model.model.embed_tokens.weight
        self.head_tied = head.data_ptr() == embedding.data_ptr()  # SmolLM2: one tensor
        self.lm_head: Gemm = lm_head_gemm(head, tied=self.head_tied)
        # The norm after each layer's MLP: the next layer's input norm, or the final one.
        self.next_norms = [layer.input_layernorm.weight for layer in self.layers[1:]] + \
            [hf_model.model.norm.weight]
        self.elementwise = elementwise_ops_for(hf_model.device)  # ch05: C++ on the CPU
        self.packed_bytes = packed_bytes([*(f.gemm for f in self.qkv + self.gate_up if f),
                                          *self.o_proj, *self.down_proj, self.lm_head])

    def release_plain_weights(self) -> None:
        """ch05: free the weights that only packed copies are read from now
        (cpu_gemm.py), so a packed model takes no more memory than a plain
        one. Only for an engine that loaded the model itself: afterwards
        HF's own forward cannot run (the tests' reference model is shared,
        and stays whole)."""
        for i, layer in enumerate(self.layers):
            for fused, linears in ((self.qkv[i], (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                  layer.self_attn.v_proj)),
                                   (self.gate_up[i], (layer.mlp.gate_proj, layer.mlp.up_proj))):
                if fused is not None and isinstance(fused.gemm, PackedLinear):
                    fused.weight = fused.weight.new_empty(0)
                    for linear_module in linears:
                        release_plain_weight(linear_module)
            for gemm, module in ((self.o_proj[i], layer.self_attn.o_proj),
                                 (self.down_proj[i], layer.mlp.down_proj)):
                if isinstance(gemm, PackedLinear):
                    release_plain_weight(module)
        if isinstance(self.lm_head, PackedLinear) and not self.head_tied:
            release_plain_weight(self.hf.lm_head)  # a tied head is the embedding: kept

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin of each token's angles, (T, D) each, once per step."""
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()  # (T, D/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        cos = (angles.cos() * self.attention_scaling).to(dtype)  # (T, D)
        sin = (angles.sin() * self.attention_scaling).to(dtype)
        return cos, sin

    def attention(self, i: int, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        """Layer i's attention block, x: (T, hidden) -> (T, hidden)."""
        attn, qkv = self.layers[i].self_attn, self.qkv[i]
        num_tokens = x.shape[0]
        if qkv is not None:  # ch05: one product, split in three (views)
            q, k, v = qkv(x)
        else:  # ch08: quantized, one product each
            q, k, v = (linear(x, proj) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q = self.elementwise.rotary(q, cos, sin)  # (T, H, D)
        k = self.elementwise.rotary(k, cos, sin)  # (T, H_kv, D)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale,
                              self.attention_ops)  # (T, H, D)
        out = self.o_proj[i](out.reshape(num_tokens, -1))  # (T, hidden)
        return self.tp.all_reduce(out)  # ch08: sum the ranks' partial outputs

    def mlp(self, i: int, x):
        """Layer i's MLP block, x: (T, hidden) -> (T, hidden)."""
        mlp, gate_up = self.layers[i].mlp, self.gate_up[i]
        if gate_up is not None:  # ch05: one product, split in two
            gate, up = gate_up(x)
        else:  # ch08: quantized
            gate, up = linear(x, mlp.gate_proj), linear(x, mlp.up_proj)
        out = self.down_proj[i](self.act(gate) * up)
        return self.tp.all_reduce(out)  # ch08: (T, hidden), summed over the ranks

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.hf.model.embed_tokens.weight
        if self.tp.is_parallel:  # ch08: this rank's vocabulary range, all-reduced
            return vocab_parallel_embedding(input_ids, weight, self.tp)
        return weight[input_ids]  # (T, hidden)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (num_tokens,). Returns hidden states (num_tokens, hidden)."""
        h = self.embed(input_ids)  # (T, hidden): the residual stream
        cos, sin = self.rotary(positions, h.dtype)
        ops = self.elementwise
        x = ops.rms_norm(h, self.layers[0].input_layernorm.weight, self.eps)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_caches[i]
            x = self.attention(i, x, cos, sin, k_cache, v_cache, meta)
            # h = h + x, then x = norm(h): one call (ch05: one pass in C++)
            x, h = ops.add_rms_norm(x, h, layer.post_attention_layernorm.weight, self.eps)
            x = self.mlp(i, x)
            x, h = ops.add_rms_norm(x, h, self.next_norms[i], self.eps)
        return x  # the last layer's "next norm" is the model's final norm

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: (N, hidden) -> (N, vocab). The head may be tied to the embedding.
        N is the number of sequences that sample this step, not of tokens.
        ch08: with N ranks each computes (N, vocab/N); rank 0 gets them all,
        the other ranks get None."""
        logits = self.lm_head(hidden)  # (N, vocab)
        return self.tp.gather_vocab(logits, self.vocab_size)  # ch08 (a no-op on one rank)


# ------------------------------------------------------- ch06: the levers
# The projections of a decoder layer that --quantization swaps, in place.
LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantizable_linears(hf_model) -> list[str]:
    """Every decoder layer's projections, as paths in the HF model."""
    return [f"model.layers.{i}.{path}" for i in range(len(hf_model.model.layers))
            for path in LLAMA_LINEARS]


def shard_llama_for_rank(hf_model, rank: int, world_size: int) -> None:
    """Keep rank `rank`'s shard of every matrix of a Llama-family HF model,
    in place (the rest is freed). Afterwards only our forward pass
    (common/models/llama.py, told the world size) can run the model:
    HF's own forward would expect the whole matrices."""
    model = hf_model.model
    tied = hf_model.lm_head.weight is model.embed_tokens.weight
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            shard_output_features(proj, rank, world_size)  # this rank's heads / features
        for proj in (attn.o_proj, mlp.down_proj):
            shard_input_features(proj, rank, world_size)  # partial sums, all-reduced
    model.embed_tokens.weight = vocab_shard(model.embed_tokens.weight, rank, world_size)
    if tied:  # SmolLM2: the head is the embedding, one shard serves both
        hf_model.lm_head.weight = model.embed_tokens.weight
    else:
        hf_model.lm_head.weight = vocab_shard(hf_model.lm_head.weight, rank, world_size)
