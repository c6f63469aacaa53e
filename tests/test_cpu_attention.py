"""ch04: decode attention in C++ on the CPU (common/layers/cpu_attention.py)
against the PyTorch reference it replaces, and the engine's greedy tokens
against HF's through it."""
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
        return cpu_attention.build_extension()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the C++ kernel does not build here: {exc}")


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", [
    [(5, 5), (36, 36), (3, 40)],  # (query_len, context_len): short prompts, a chunk's tail
    [(100, 200), (64, 64)],  # a long chunk (the reference) beside a short one
    [(120, 130)],  # long only
])
def test_prefill_as_decode_rows_matches_the_reference(dtype, chunks):
    """Issue 35: short prefill chunks through the decode kernel, one row per
    new token, the long ones through the reference: the causal result."""
    kernel_or_skip()
    query_lens = [q for q, _ in chunks]
    _, k_cache, v_cache, tables, lens = random_paged_batch(
        [c for _, c in chunks], 9, 3, 64, 16, dtype)
    gen = torch.Generator().manual_seed(len(chunks))
    query = torch.randn(sum(query_lens), 9, 64, generator=gen).to(dtype)
    loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = cpu_attention.CpuOps.paged_prefill_attention(query, k_cache, v_cache, tables, loc,
                                                       lens, 0.125)
    expected = attention.paged_prefill_attention(query.float(), k_cache.float(),
                                                 v_cache.float(), tables, loc, lens, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


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

    monkeypatch.setattr(cpu_attention, "build_extension", no_compiler)
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
