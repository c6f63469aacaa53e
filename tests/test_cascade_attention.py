"""Cascade attention (ch05, common/layers/cascade_attention.py): the C++
kernels of its three parts against their PyTorch reference, the cascade
against plain decode attention, when a step cascades, and the engine's
greedy tokens with it on: the same as with it off, and as HF's."""
from __future__ import annotations

import pytest
import torch

from common.layers import attention, cascade_attention, cpu_attention
from common.layers.cascade_attention import MIN_COMMON_PREFIX_TOKENS, num_common_prefix_blocks
from common.loader import apply_chat_template
from tests.components import Components
from tests.conftest import hf_greedy
from tests.engine_helpers import greedy, make_engine, run_all
from tests.test_cpu_attention import kernel_or_skip, random_paged_batch


def shared_batch(num_seqs, prefix_blocks, suffix_lens, heads, block_size, dtype):
    """A paged batch whose sequences all begin with the same `prefix_blocks`
    blocks, then have blocks of their own (`suffix_lens` tokens each)."""
    prefix_len = prefix_blocks * block_size
    query, k_cache, v_cache, tables, lens = random_paged_batch(
        [prefix_len + n for n in suffix_lens[:num_seqs]], *heads, block_size, dtype)
    tables[:, :prefix_blocks] = tables[0, :prefix_blocks].clone()  # the first one's, for all
    return query, k_cache, v_cache, tables, lens


def tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])  # (H, H_kv, D)
def test_shared_prefix_kernel_matches_the_reference(dtype, heads):
    kernel_or_skip()
    for num_seqs in (1, 5, 16, 70):  # one tile of queries, several, more than kQueryTile
        query, k_cache, v_cache, tables, _ = shared_batch(
            num_seqs, 7, [3] * num_seqs, heads, 16, dtype)
        scale = heads[2] ** -0.5
        out, lse = cpu_attention.CpuOps.shared_prefix_attention(query, k_cache, v_cache,
                                                                tables[0, :7], scale)
        expected, expected_lse = cascade_attention.shared_prefix_attention(
            query.float(), k_cache.float(), v_cache.float(), tables[0, :7], scale)
        assert out.dtype == dtype and lse.shape == query.shape[:2]
        torch.testing.assert_close(out.float(), expected, rtol=tolerance(dtype),
                                   atol=tolerance(dtype))
        torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens", [[1, 7, 16, 17, 50, 300, 33], [2100, 513, 3]])
def test_decode_kernel_log_sum_exps_match_the_reference(dtype, context_lens):
    """Whole contexts, and (on 2 threads) contexts cut into pieces."""
    kernel = kernel_or_skip()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        query, k_cache, v_cache, tables, lens = random_paged_batch(context_lens, 9, 3, 64, 16,
                                                                   dtype)
        out, lse = kernel.paged_decode_attention_lse(query, k_cache, v_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    expected, expected_lse = cascade_attention.paged_decode_attention_lse(
        query.float(), k_cache.float(), v_cache.float(), tables, lens, 0.125)
    torch.testing.assert_close(out.float(), expected, rtol=tolerance(dtype), atol=tolerance(dtype))
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-4)
    # and the same output as the kernel without log-sum-exps
    torch.testing.assert_close(out, kernel.paged_decode_attention(query, k_cache, v_cache,
                                                                  tables, lens, 0.125))


def test_the_merge_kernel_matches_the_reference():
    kernel = kernel_or_skip()
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(6, 9, 64, generator=gen), torch.randn(6, 9, generator=gen) * 3,
             torch.randn(6, 9, 64, generator=gen), torch.randn(6, 9, generator=gen) * 3]
    torch.testing.assert_close(kernel.merge_attn_states(*parts),
                               attention.merge_attn_states(*parts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 1])
def test_cascade_gives_plain_decode_attention(dtype, block_size):
    """Prefix once for all, suffixes each, merged: what each sequence's
    attention over its whole context gives (suffixes of 1 token to several
    blocks), through the C++ kernels and through the reference."""
    kernel_or_skip()
    prefix_blocks = 300 // block_size
    query, k_cache, v_cache, tables, lens = shared_batch(
        9, prefix_blocks, [1, 2, 15, 16, 17, 40, 100, 5, 33], (9, 3, 64), block_size, dtype)
    expected = attention.paged_decode_attention(query.float(), k_cache.float(), v_cache.float(),
                                                tables, lens, 0.125)

    class ReferenceCascade(attention.TorchOps):  # the PyTorch specification of the three
        shared_prefix_attention = staticmethod(cascade_attention.shared_prefix_attention)
        paged_decode_attention_lse = staticmethod(cascade_attention.paged_decode_attention_lse)
        merge_attn_states = staticmethod(attention.merge_attn_states)

    for ops in (cpu_attention.CpuOps, ReferenceCascade):
        out = attention.cascade_attention(query, k_cache, v_cache, tables, lens, prefix_blocks,
                                          0.125, ops)
        torch.testing.assert_close(out.float(), expected, rtol=tolerance(dtype),
                                   atol=tolerance(dtype))


def test_a_step_cascades_when_every_decode_shares_enough_blocks():
    bs, blocks = 16, MIN_COMMON_PREFIX_TOKENS // 16  # the least prefix that cascades
    shared = list(range(blocks))
    tables = [shared + [100 + i, 200 + i] for i in range(8)]
    lens = [(blocks + 1) * bs + 3] * 8  # the last block (200 + i) holds the new token
    assert num_common_prefix_blocks(tables, lens, bs) == blocks
    assert num_common_prefix_blocks(tables[:7], lens[:7], bs) == 0  # fewer than 8 decodes
    assert num_common_prefix_blocks([t[1:] for t in tables], lens, bs) == 0  # 240 tokens
    tables[5][3] = 99  # one sequence differs at block 3: the prefix ends there
    assert num_common_prefix_blocks(tables, lens, bs) == 0
    tables[5][3] = 3
    # one context ends in the shared blocks: its last one is never in the
    # prefix (it holds the new token), so the prefix is 15 blocks: too short
    lens[2] = blocks * bs
    assert num_common_prefix_blocks(tables, lens, bs) == 0


class CountingOps(cpu_attention.CpuOps):
    """The C++ kernels, counting the steps' layers that cascaded."""
    cascades = 0

    @staticmethod
    def shared_prefix_attention(*args):
        CountingOps.cascades += 1
        return cpu_attention.CpuOps.shared_prefix_attention(*args)


def test_engine_with_cascade_gives_the_same_greedy_tokens_as_without_and_as_hf(embedded):
    """Float32: one request's 300-token document prefilled first, then 8
    more asking about it; their decode steps cascade (prefix caching gives
    them its blocks). Their tokens: the engine's without cascade, and HF's."""
    kernel_or_skip()
    tok = embedded.tokenizer
    document = " ".join(f"Fact {i}: the {i}th stone of the wall is grey." for i in range(28))
    prompts = {f"q{i}": apply_chat_template(tok, [{"role": "user", "content":
                                                   f"{document}\nQuestion {i}: which stone?"}])
               for i in range(9)}
    assert len(prompts["q0"]) > MIN_COMMON_PREFIX_TOKENS + 32

    def run(disable_cascade_attn):
        engine = make_engine(embedded, block_size=16, enable_prefix_caching=True,
                             disable_cascade_attn=disable_cascade_attn,
                             impl=Components(attention_ops=CountingOps))
        first = dict(list(prompts.items())[:1])
        for request_id, ids in first.items():
            engine.add_request(request_id, ids, greedy(12))
        while not engine.step():  # until its prompt is in the cache: its first token
            pass
        done = run_all(engine, dict(list(prompts.items())[1:]), greedy(12))
        return {rid: out.token_ids for rid, out in done.items()}

    CountingOps.cascades = 0
    plain = run(disable_cascade_attn=True)
    assert CountingOps.cascades == 0
    cascaded = run(disable_cascade_attn=False)
    assert CountingOps.cascades > 0, "no step cascaded"
    assert cascaded == plain
    assert cascaded["q1"] == hf_greedy(embedded.model, prompts["q1"], 12)
