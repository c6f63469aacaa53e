"""ch04: decode and prefill attention in C++ on the CPU
(common/layers/cpu_attention.py) against the PyTorch reference they
replace, and the engine's greedy tokens against HF's through them."""
from __future__ import annotations

import pytest
import torch

from common.layers import attention, cpu_attention
from common.layers.attention_selector import attention_ops_for
from common.loader import apply_chat_template
from tests.components import Components
from tests.conftest import PROMPTS, hf_greedy
from tests.engine_helpers import greedy, make_engine, run_all


def kernel_or_skip():
    try:
        return cpu_attention.build_extensions()[0]
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the C++ kernels do not build here: {exc}")


def random_paged_batch(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """A cache with each sequence's blocks scattered at random, and one query each."""
    gen = torch.Generator().manual_seed(sum(context_lens) + block_size)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq)
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(order[start:start + n] + [0] * (max_blocks - n))
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(dtype)
    return (query, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
            torch.tensor(context_lens, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])  # (H, H_kv, D)
@pytest.mark.parametrize("block_size", [1, 16, 512])  # 512: chapter 03's one region
def test_decode_kernel_matches_the_reference(dtype, heads, block_size):
    kernel = kernel_or_skip()
    num_heads, num_kv_heads, head_dim = heads
    context_lens = [1, 7, 16, 17, 50, 300, 33]
    query, k_cache, v_cache, tables, lens = random_paged_batch(
        context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    out = kernel.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    # The specification: the reference in float32 on the same values.
    expected = attention.paged_decode_attention(query.float(), k_cache.float(), v_cache.float(),
                                                tables, lens, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_decode_kernel_cuts_long_contexts_into_pieces_and_merges_them():
    """Flash-decoding: where one context is more than a thread's share of
    the batch, contexts above 512 tokens run as pieces on different threads;
    merged, they give the reference's result (several pieces, a piece and a
    token, beside a short context; one context alone)."""
    kernel = kernel_or_skip()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # pieces are cut for more threads than a context's share
    try:
        check_pieces(kernel)
    finally:
        torch.set_num_threads(threads)


def check_pieces(kernel):
    for dtype, context_lens in ((torch.float32, [2100, 513, 3]), (torch.bfloat16, [2100, 513, 3]),
                                (torch.float32, [600])):
        query, k_cache, v_cache, tables, lens = random_paged_batch(
            context_lens, 9, 3, 64, 16, dtype)
        out = kernel.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
        expected = attention.paged_decode_attention(query.float(), k_cache.float(),
                                                    v_cache.float(), tables, lens, 0.125)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def random_chunks(chunks, heads, block_size, dtype):
    """A paged cache and the new tokens of chunks given as (query_len, context_len)."""
    num_heads, num_kv_heads, head_dim = heads
    _, k_cache, v_cache, tables, lens = random_paged_batch(
        [c for _, c in chunks], num_heads, num_kv_heads, head_dim, block_size, dtype)
    query_lens = [q for q, _ in chunks]
    gen = torch.Generator().manual_seed(len(chunks) + head_dim)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, k_cache, v_cache, tables, loc, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", [
    [(5, 5), (36, 36), (1, 1)],  # (query_len, context_len): short prompts
    [(100, 100), (3, 40), (64, 64)],  # a long prompt beside a chunk's tail and a short one
    [(300, 300)],  # long: ten query tiles, five key tiles
    [(128, 640), (40, 1000)],  # later chunks of long prompts
    [(20, 992), (1, 17)],  # prefix hits: the new tokens after a cached prefix
])
def test_prefill_kernel_matches_the_reference(dtype, chunks):
    """Issue 50: every chunk through the tiled kernel (and through what the
    engine's CpuOps picks), the causal result."""
    kernel_or_skip()
    args = random_chunks(chunks, (9, 3, 64), 16, dtype)
    expected = attention.paged_prefill_attention(
        *(a.float() if a.is_floating_point() else a for a in args), 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for attend in (cpu_attention.build_prefill_extension().paged_prefill_attention,
                   cpu_attention.CpuOps.paged_prefill_attention):
        out = attend(*args, 0.125)
        assert out.dtype == dtype and out.shape == args[0].shape
        torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_with_amx_long_bfloat16_chunks_go_to_the_reference(monkeypatch):
    """A batch of short and long bfloat16 chunks on a CPU with AMX: the long
    ones through the reference's SDPA, the short ones (and a few new tokens
    after a long prefix) through the kernel, each row back in its place."""
    kernel_or_skip()
    monkeypatch.setattr(cpu_attention, "cpu_has_amx", lambda: True)
    chunks = [(5, 5), (200, 200), (30, 1030), (3, 40), (128, 300)]
    args = random_chunks(chunks, (9, 3, 64), 16, torch.bfloat16)
    picked = cpu_attention.to_the_reference(args[0], args[4], args[5])
    assert picked.tolist() == [False, True, False, False, True]
    calls = []
    reference = attention.TorchOps.paged_prefill_attention
    monkeypatch.setattr(attention.TorchOps, "paged_prefill_attention", staticmethod(
        lambda *a: calls.append(a[4].diff().tolist()) or reference(*a)))
    out = cpu_attention.CpuOps.paged_prefill_attention(*args, 0.125)
    assert calls == [[200, 128]]
    expected = reference(*(a.float() if a.is_floating_point() else a for a in args), 0.125)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("heads", [(8, 2, 128), (4, 4, 64), (6, 2, 32)])  # 32: the reference
@pytest.mark.parametrize("block_size", [1, 16, 512])
def test_prefill_kernel_takes_any_grouping_and_block_size(heads, block_size):
    kernel_or_skip()
    args = random_chunks([(70, 70), (33, 130)], heads, block_size, torch.float32)
    torch.testing.assert_close(
        cpu_attention.CpuOps.paged_prefill_attention(*args, 0.1),
        attention.paged_prefill_attention(*args, 0.1), rtol=1e-5, atol=1e-5)


def test_decode_kernel_takes_a_strided_query():
    """The engine's query is a view of the fused q/k/v product."""
    kernel = kernel_or_skip()
    query, k_cache, v_cache, tables, lens = random_paged_batch(
        [5, 40], 6, 2, 16, 8, torch.float32)
    strided = torch.cat([query, query], dim=-1)[..., :16]  # not contiguous
    assert not strided.is_contiguous()
    torch.testing.assert_close(
        kernel.paged_decode_attention(strided, k_cache, v_cache, tables, lens, 0.25),
        attention.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.25))


def test_the_cpu_gets_the_kernel_or_the_reference_when_it_does_not_build(monkeypatch):
    kernel_or_skip()
    assert attention_ops_for(torch.device("cpu")) is cpu_attention.CpuOps

    def no_compiler():
        raise RuntimeError("Error building extension: g++ not found")

    monkeypatch.setattr(cpu_attention, "build_prefill_extension", no_compiler)
    cpu_attention.cpu_attention_ops.cache_clear()
    try:
        assert cpu_attention.cpu_attention_ops() is attention.TorchOps
    finally:
        cpu_attention.cpu_attention_ops.cache_clear()


def test_engine_through_the_kernel_gives_hf_greedy_tokens(embedded):
    """Float32, blocks of 16, continuous batching: HF's tokens."""
    kernel_or_skip()
    prompts = {str(i): apply_chat_template(embedded.tokenizer, m) for i, m in enumerate(PROMPTS)}
    engine = make_engine(embedded, block_size=16, impl=Components(attention_ops=cpu_attention.CpuOps))
    done = run_all(engine, prompts, greedy(32))
    for request_id, ids in prompts.items():
        assert done[request_id].token_ids == hf_greedy(embedded.model, ids, 32)


def test_pip_ninja_is_found_without_an_activated_venv(monkeypatch, tmp_path):
    """A PATH without ninja (the venv not activated, no system ninja):
    the one beside this Python goes first on PATH."""
    import os
    import sysconfig

    from common.layers import cpp_extensions
    scripts = sysconfig.get_path("scripts")
    if not os.path.exists(os.path.join(scripts, "ninja")):
        pytest.skip("ninja is not pip-installed beside this Python (make setup installs it)")
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    cpp_extensions.ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == scripts
