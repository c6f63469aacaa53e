"""Chapter 04: the Triton kernels agree with the PyTorch reference.

Without a GPU the kernels run on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1, set below before common.layers.triton_kernels is imported).
The interpreter is slow, so these cases are small: head_dim 16, a handful of
heads and sequences. With a GPU, the same comparisons run on CUDA tensors,
and `test_on_cuda_bfloat16` repeats them in bfloat16 at real head sizes.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

ON_CUDA = torch.cuda.is_available()


def use_triton_interpreter() -> None:
    """Make `@triton.jit` kernels run on the CPU, in Python.

    Triton reads TRITON_INTERPRET when a kernel is *defined*: ours, and also
    its own library kernels (tl.sum, tl.max, tl.zeros are `@triton.jit`
    functions, defined when triton.language is imported). If triton was
    imported before this runs (conftest's imports pull it in through
    transformers), those are defined again, for the interpreter.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules:
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(sys.modules["triton.language"].sum, InterpretedFunction):
            for name in ("triton.language.standard", "triton.language.random",
                         "triton.language"):
                importlib.reload(sys.modules[name])
        kernels = sys.modules.get("common.layers.triton_kernels")
        if kernels is not None and not isinstance(kernels._store_kvcache_kernel,
                                                  InterpretedFunction):
            importlib.reload(kernels)


if not ON_CUDA:
    use_triton_interpreter()  # before common.layers.triton_kernels defines its kernels

from common.layers import attention as reference  # noqa: E402
from common.layers import triton_kernels  # noqa: E402
from common.layers.attention_selector import attention_ops_for  # noqa: E402

pytestmark = pytest.mark.ch04
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
HEAD_DIM = 16  # small: the interpreter's cost grows with it
GQA = [pytest.param(4, 4, id="mha-4/4"), pytest.param(3, 9, id="gqa-9/3")]  # (H_kv, H)
BLOCK_SIZES = [16, 8]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def context_lengths(block_size: int) -> list[int]:
    """The edges: one token, one short of a block, a block, one over, long."""
    return [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3]


def make_paged_cache(context_lens: list[int], block_size: int, num_kv_heads: int,
                     head_dim: int, dtype: torch.dtype, device: torch.device,
                     seed: int = 0):
    """A random cache and block tables whose blocks are shuffled physical
    blocks (never in order, never contiguous), padded with 0 like the engine's.

    Returns k_cache, v_cache (num_blocks, block_size, H_kv, D),
    block_tables (num_seqs, max_blocks) int32, context_lens (num_seqs,) int32.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [cdiv(n, block_size) for n in context_lens]
    num_blocks = sum(blocks_needed) + 3  # a few blocks nobody owns
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(context_lens), max(blocks_needed), dtype=torch.int32)
    for i, n in enumerate(blocks_needed):
        block_tables[i, :n] = torch.tensor([physical.pop() for _ in range(n)])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return (k_cache.to(device), v_cache.to(device), block_tables.to(device),
            torch.tensor(context_lens, dtype=torch.int32, device=device))


def strided_query(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device, seed: int = 1) -> torch.Tensor:
    """(num_tokens, num_heads, head_dim), a non-contiguous view, as when the
    model splits one fused qkv projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, num_heads + 2, head_dim, generator=gen).to(dtype).to(device)
    return qkv[:, :num_heads]


def reference_in_float32(fn, *tensors_and_args):
    """The reference on float32 copies: the truth a bfloat16 kernel is held to."""
    args = [t.float() if torch.is_tensor(t) and t.is_floating_point() else t
            for t in tensors_and_args]
    return fn(*args)


def check_decode(context_lens: list[int], block_size: int, num_kv_heads: int,
                 num_heads: int, head_dim: int, dtype: torch.dtype, tol: float,
                 **split_k) -> None:
    k_cache, v_cache, block_tables, lens = make_paged_cache(
        context_lens, block_size, num_kv_heads, head_dim, dtype, DEVICE)
    query = strided_query(len(context_lens), num_heads, head_dim, dtype, DEVICE)
    scale = head_dim ** -0.5
    out = triton_kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, lens,
                                                scale, **split_k)
    expected = reference_in_float32(reference.paged_decode_attention, query, k_cache, v_cache,
                                    block_tables, lens, scale)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def check_prefill(seqs: list[tuple[int, int]], block_size: int, num_kv_heads: int,
                  num_heads: int, head_dim: int, dtype: torch.dtype, tol: float) -> None:
    """seqs: (context_len, query_len) per sequence; the query tokens are the
    last query_len of the context, the others a cached prefix."""
    context_lens = [c for c, _ in seqs]
    query_lens = [q for _, q in seqs]
    k_cache, v_cache, block_tables, lens = make_paged_cache(
        context_lens, block_size, num_kv_heads, head_dim, dtype, DEVICE)
    query_start_loc = torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).to(torch.int32)
    query = strided_query(sum(query_lens), num_heads, head_dim, dtype, DEVICE)
    scale = head_dim ** -0.5
    out = triton_kernels.paged_prefill_attention(query, k_cache, v_cache, block_tables,
                                                 query_start_loc, lens, scale)
    expected = reference_in_float32(reference.paged_prefill_attention, query, k_cache, v_cache,
                                    block_tables, query_start_loc, lens, scale)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def prefill_cases(block_size: int) -> list[tuple[int, int]]:
    """(context_len, query_len): whole prompts, then prompts with a cached
    prefix; two of them need two tiles of queries (a tile has at most
    PREFILL_ROWS tokens)."""
    m = triton_kernels.PREFILL_ROWS
    whole = [(n, n) for n in context_lengths(block_size)] + [(m + 6, m + 6)]
    with_prefix = [(block_size, 3), (block_size + 1, 1), (5 * block_size + 3, block_size + 2),
                   (m + 6 + block_size, m + 6)]
    return whole + with_prefix


def check_store(num_tokens: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    num_blocks = cdiv(num_tokens, block_size) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Scattered, distinct slots; key and value are views of one fused tensor.
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slot_mapping = slot_mapping.to(DEVICE)

    k_cache = torch.full(shape, -7.0, dtype=dtype, device=DEVICE)  # -7: "untouched"
    v_cache = torch.full(shape, -7.0, dtype=dtype, device=DEVICE)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    triton_kernels.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    reference.store_kvcache(key, value, k_expected, v_expected, slot_mapping)

    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    written = torch.zeros(k_flat.shape[0], dtype=torch.bool, device=DEVICE)
    written[slot_mapping] = True
    assert torch.equal(k_flat[slot_mapping], key)
    assert bool((k_flat[~written] == -7.0).all()), "a slot outside slot_mapping changed"


# --- float32, on the interpreter (or on CUDA when there is one) ------------

@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_kv_heads,num_heads", GQA)
def test_decode_matches_reference(block_size, num_kv_heads, num_heads):
    check_decode(context_lengths(block_size), block_size, num_kv_heads, num_heads,
                 HEAD_DIM, torch.float32, tol=1e-5)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_kv_heads,num_heads", GQA)
def test_prefill_matches_reference(block_size, num_kv_heads, num_heads):
    check_prefill(prefill_cases(block_size), block_size, num_kv_heads, num_heads,
                  HEAD_DIM, torch.float32, tol=1e-5)


# Grouped-query shapes at their real head sizes: (H_kv, H, head_dim). Each
# decode program holds a KV head's whole group of query heads (1, 3, 4, 8).
MODEL_SHAPES = [pytest.param(3, 9, 64, id="SmolLM2-135M-9/3"),
                pytest.param(8, 32, 128, id="Llama-3-8B-32/8"),
                pytest.param(2, 2, 32, id="mha-1-per-kv"),
                pytest.param(2, 8, 32, id="gqa-4-per-kv"),
                pytest.param(1, 8, 32, id="mqa-8-per-kv")]
MIXED_CONTEXTS = [37, 1, 16, 130, 17]  # 1 to 9 blocks of 16, the longest first


@pytest.mark.parametrize("num_kv_heads,num_heads,head_dim", MODEL_SHAPES)
def test_grouped_decode_at_model_shapes(num_kv_heads, num_heads, head_dim):
    check_decode(MIXED_CONTEXTS, 16, num_kv_heads, num_heads, head_dim, torch.float32,
                 tol=1e-5)


@pytest.mark.parametrize("num_kv_heads,num_heads,head_dim", MODEL_SHAPES)
def test_split_k_decode_at_model_shapes(num_kv_heads, num_heads, head_dim):
    """Partitions of 32 positions: 130 tokens make 5, of which the last holds
    2; the 1-token context leaves 4 partitions empty (weight 0 in the merge)."""
    check_decode(MIXED_CONTEXTS, 16, num_kv_heads, num_heads, head_dim, torch.float32,
                 tol=1e-5, num_splits=5, partition_size=32)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_split_k_default_partition_on_a_long_context(block_size):
    """The real partition (512 positions): 1100 tokens make three, beside
    short contexts whose later partitions are empty."""
    num_splits = cdiv(1100, triton_kernels.PARTITION_SIZE)
    check_decode([3, 1100, 513], block_size, 1, 4, HEAD_DIM, torch.float32, tol=1e-5,
                 num_splits=num_splits)


def test_decode_num_splits_keeps_every_multiprocessor_busy():
    choose = triton_kernels.decode_num_splits
    assert choose(num_seqs=64, num_kv_heads=8, max_context=8192, multiprocessors=132) == 1
    assert choose(num_seqs=4, num_kv_heads=8, max_context=8192, multiprocessors=132) == 16
    assert choose(num_seqs=4, num_kv_heads=8, max_context=512, multiprocessors=132) == 1
    assert choose(num_seqs=1, num_kv_heads=3, max_context=1000, multiprocessors=132) == 2


@pytest.mark.parametrize("num_kv_heads,num_heads,head_dim", MODEL_SHAPES)
def test_grouped_prefill_at_model_shapes(num_kv_heads, num_heads, head_dim):
    """Rows of (token, head) pairs: a group of 8 takes 8 tokens a tile, so
    the 40-token query spans five tiles; prefixes cached or not."""
    check_prefill([(40, 40), (16, 1), (50, 13), (7, 7), (130, 20)], 16, num_kv_heads,
                  num_heads, head_dim, torch.float32, tol=1e-5)


@pytest.mark.parametrize("block_size", [1, 12])
def test_tiny_and_odd_block_sizes(block_size):
    """Block size 1 (sixteen blocks per tile) and 12 (not a power of two, like
    chapter 03's max_model_len regions): the kernels look up each position."""
    check_decode([1, 13, 29], block_size, 3, 9, HEAD_DIM, torch.float32, tol=1e-5)
    check_prefill([(1, 1), (13, 13), (29, 5)], block_size, 3, 9, HEAD_DIM, torch.float32,
                  tol=1e-5)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_kv_heads", [3, 4])
def test_store_kvcache_writes_exactly_the_given_slots(block_size, num_kv_heads):
    check_store(21, block_size, num_kv_heads, HEAD_DIM, torch.float32)


def test_store_kvcache_skips_slot_minus_one():
    """The padding rows of a CUDA graph's batch write nothing (slot -1)."""
    key = torch.randn(3, 2, HEAD_DIM, device=DEVICE)
    value = torch.randn(3, 2, HEAD_DIM, device=DEVICE)
    k_cache = torch.zeros(2, 4, 2, HEAD_DIM, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, -1, 2], device=DEVICE)
    triton_kernels.store_kvcache(key, value, k_cache, v_cache, slots)
    flat = k_cache.view(-1, 2, HEAD_DIM)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[2], key[2])
    assert int((flat.abs().sum(dim=(1, 2)) > 0).sum()) == 2  # nothing else written
    assert torch.equal(v_cache.view(-1, 2, HEAD_DIM)[5], value[0])


def test_head_dim_not_a_power_of_two_is_refused_clearly():
    query = torch.zeros(1, 2, 24, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 24, device=DEVICE)
    with pytest.raises(AssertionError, match="power of two"):
        triton_kernels.paged_decode_attention(
            query, cache, cache, torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
            torch.ones(1, dtype=torch.int32, device=DEVICE), 1.0)


# --- the engine through the kernels -----------------------------------------

@pytest.fixture(scope="module")
def attentive_llama():
    """The tiny Llama with its attention and final norm scaled up. At their
    usual scale, random weights attend almost uniformly, add little to the
    residual stream and give every token about the same logprob, so even a
    wrong softmax would leave the logprobs as they were; scaled, each query
    picks a few positions and what it reads moves the logprobs."""
    from common.loader import load_model
    loaded = load_model("tiny-llama", dtype="float32", device="cpu", load_format="dummy")
    with torch.no_grad():
        for layer in loaded.model.model.layers:
            for proj, scale in ATTENTION_SCALES.items():
                getattr(layer.self_attn, proj).weight.mul_(scale)
        loaded.model.model.norm.weight.mul_(FINAL_NORM_SCALE)
    return loaded


ATTENTION_SCALES = {"q_proj": 6.0, "k_proj": 6.0, "v_proj": 20.0, "o_proj": 20.0}
FINAL_NORM_SCALE = 50.0


class SplitKOps:
    """The Triton kernels with split-K forced: partitions of 16 positions."""
    store_kvcache = staticmethod(triton_kernels.store_kvcache)
    paged_prefill_attention = staticmethod(triton_kernels.paged_prefill_attention)

    @staticmethod
    def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale):
        splits = cdiv(block_tables.shape[1] * k_cache.shape[1], 16)
        return triton_kernels.paged_decode_attention(query, k_cache, v_cache, block_tables,
                                                     context_lens, scale, num_splits=splits,
                                                     partition_size=16)


@pytest.mark.skipif(ON_CUDA, reason="on CUDA the engine picks these kernels itself "
                                    "(bench/gpu/gpu_check.py's correctness step)")
@pytest.mark.parametrize("ops", [triton_kernels, SplitKOps], ids=["triton", "split-k"])
def test_the_engine_through_the_kernels_gives_hf_greedy_tokens(attentive_llama, ops):
    """The tiny Llama (4 query heads, 2 KV heads, head_dim 16) served by the
    engine with the Triton kernels, interpreted: fused-qkv views, prefills
    beside decodes, a request arriving mid-run. Greedy tokens == HF
    generate's, and so are their logprobs, to 1e-4."""
    from common.config import EngineConfig
    from common.engine.parts import assemble_engine
    from tests.engine_helpers import greedy, run_all

    engine = assemble_engine(EngineConfig(model="tiny-llama", dtype="float32", device="cpu",
                                          load_format="dummy"),
                             loaded=attentive_llama, num_blocks=32, attention_ops=ops)
    prompts = {str(n): [1 + (13 * n + j) % 400 for j in range(n)] for n in (5, 20, 37)}
    params = greedy(max_tokens=10, ignore_eos=True, logprobs=0)
    engine.add_request("5", prompts["5"], params)
    engine.step()  # its prefill: "20" and "37" then prefill while it decodes
    done = run_all(engine, {"20": prompts["20"], "37": prompts["37"]}, params)
    for request_id, ids in prompts.items():
        input_ids = torch.tensor([ids])
        hf = attentive_llama.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=10,
            min_new_tokens=10, do_sample=False, output_logits=True,
            return_dict_in_generate=True)
        expected = hf.sequences[0, len(ids):].tolist()
        expected_logprobs = [torch.log_softmax(step[0], dim=-1)[token].item()
                             for step, token in zip(hf.logits, expected)]
        output = done[request_id]
        assert output.token_ids == expected, request_id
        torch.testing.assert_close([t.logprob for t in output.logprobs], expected_logprobs,
                                   rtol=0, atol=1e-4)


# --- bfloat16 on a real GPU -------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_kv_heads,num_heads", GQA)
def test_on_cuda_bfloat16(head_dim, block_size, num_kv_heads, num_heads):
    # Held to the float32 reference on the same (bfloat16) numbers: the
    # output's rounding and p's cast to bfloat16 before p @ V stay below 2e-2.
    tol = 2e-2
    check_decode(context_lengths(block_size) + [700], block_size, num_kv_heads, num_heads,
                 head_dim, torch.bfloat16, tol)
    check_decode(context_lengths(block_size) + [700], block_size, num_kv_heads, num_heads,
                 head_dim, torch.bfloat16, tol, num_splits=3, partition_size=256)
    check_prefill(prefill_cases(block_size) + [(700, 300)], block_size, num_kv_heads,
                  num_heads, head_dim, torch.bfloat16, tol)
    check_store(300, block_size, num_kv_heads, head_dim, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_paged_attention_dispatches_to_triton_on_cuda():
    """attention.paged_attention on CUDA tensors (store, then decode rows and
    prefill rows through the Triton kernels) == the reference step by step."""
    block_size, num_kv_heads, num_heads, head_dim, dtype = 16, 3, 9, 64, torch.bfloat16
    seqs = [(5, 1), (17, 1), (40, 1), (20, 20), (50, 13)]  # (context_len, query_len)
    context_lens = [c for c, _ in seqs]
    k_cache, v_cache, block_tables, lens = make_paged_cache(
        context_lens, block_size, num_kv_heads, head_dim, dtype, DEVICE)
    # The new tokens are the last query_len positions of each sequence.
    slots = []
    for i, (context_len, query_len) in enumerate(seqs):
        for pos in range(context_len - query_len, context_len):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    num_tokens = len(slots)
    meta = reference.AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        query_start_loc=torch.tensor([0] + [q for _, q in seqs], device=DEVICE)
        .cumsum(0).to(torch.int32),
        context_lens=lens, block_tables=block_tables, num_decodes=3, block_size=block_size)
    query = strided_query(num_tokens, num_heads, head_dim, dtype, DEVICE)
    kv = strided_query(num_tokens, 2 * num_kv_heads, head_dim, dtype, DEVICE, seed=3)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    scale = head_dim ** -0.5

    k32, v32 = k_cache.float(), v_cache.float()  # the reference's copy, before the store
    out = reference.paged_attention(query, key, value, k_cache, v_cache, meta, scale,
                                    attention_ops_for(query.device))

    reference.store_kvcache(key.float(), value.float(), k32, v32, meta.slot_mapping)
    assert torch.equal(k_cache.float(), k32) and torch.equal(v_cache.float(), v32)
    q32 = query.float()
    expected = torch.cat([
        reference.paged_decode_attention(q32[:3], k32, v32, block_tables[:3], lens[:3], scale),
        reference.paged_prefill_attention(q32[3:], k32, v32, block_tables[3:],
                                          meta.query_start_loc[3:] - 3, lens[3:], scale)])
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
