"""LoRA adapters (ch10, common/lora/): the gathered, grouped and stacked products
against a per-row loop over merged weights; an adapter read from the
folder peft saves; our forward pass with an adapter in a slot against HF's
on peft's merged model; a mixed batch giving each sequence what it gets alone."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common.layers.attention import AttentionMetadata
from common.lora.lora_model import LoRALoadError, LoRAModel
from common.lora.model_manager import LoRAModelManager
from common.lora.punica import NO_LORA, LoRAMapping, add_lora_gathered, add_lora_grouped
from common.lora.punica_wrapper import LoRAKernel, PunicaWrapper, add_lora_stacked, slot_onehot
from common.memory import Card
from common.models import build_forward
from common.worker.kv_cache import KVCache
from tests.adapters import peft_adapter

TINY_LLAMA = LlamaConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, vocab_size=1000,
                         max_position_embeddings=256)


def random_stacks(slots=3, rank=4, d_in=16, d_out=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, rank, d_in, generator=gen),
            torch.randn(slots, d_out, rank, generator=gen),
            torch.tensor([0.5, 2.0, 4.0][:slots]))  # alpha / r of each slot


@pytest.mark.parametrize("indices", [[0, 2, NO_LORA, 2, 1, 0, NO_LORA], [1] * 5,
                                     [NO_LORA] * 4, [2]])
def test_the_three_forms_of_the_products_give_each_row_its_adapter(indices):
    lora_a, lora_b, scaling = random_stacks()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(indices), 16, generator=gen)
    base = torch.randn(len(indices), 24, generator=gen)
    expected = base.clone()
    for t, slot in enumerate(indices):  # row by row: s x_t (B A)^T for its own slot
        if slot != NO_LORA:
            expected[t] += scaling[slot] * x[t] @ (lora_b[slot] @ lora_a[slot]).T
    idx = torch.tensor(indices)
    gathered, grouped, stacked, stacked_view = (base.clone() for _ in range(4))
    add_lora_gathered(gathered, x, lora_a, lora_b, scaling, idx)
    add_lora_grouped(grouped, x, lora_a, lora_b, scaling, LoRAMapping.from_indices(idx))
    onehot = slot_onehot(idx, 3, torch.float32)
    add_lora_stacked(stacked, x, lora_a, lora_b, scaling, onehot)
    b_view = lora_b.transpose(1, 2).contiguous().transpose(1, 2)  # LoRASlots' layout
    add_lora_stacked(stacked_view, x, lora_a, b_view, scaling, onehot)
    for got in (gathered, grouped, stacked, stacked_view):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("indices", [[0, 0, NO_LORA], [2, NO_LORA, 2], [1, 0, 2, 1]])
def test_each_wrapper_kernel_gives_the_gathered_reference(indices):
    """The wrapper the LoRA layers call, in each form; the stacked one reads
    only the slots up to the last one the step uses."""
    lora_a, lora_b, scaling = random_stacks()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(len(indices), 16, generator=gen)
    expected = torch.zeros(len(indices), 24)
    add_lora_gathered(expected, x, lora_a, lora_b, scaling, torch.tensor(indices))
    for kernel in LoRAKernel:
        wrapper, y = PunicaWrapper(kernel), torch.zeros(len(indices), 24)
        wrapper.update_metadata(torch.tensor(indices))
        wrapper.add_lora_linear(y, x, lora_a, lora_b, scaling)
        torch.testing.assert_close(y, expected, msg=str(kernel))
    assert wrapper.num_slots == max(indices) + 1


def flat_batch(sequences: list[list[int]], block_size: int = 16):
    """Prefill of several sequences at once: ids, positions, metadata, blocks."""
    ids, positions, slots, starts, lens, tables = [], [], [], [0], [], []
    next_block = 0
    for seq in sequences:
        blocks = list(range(next_block, next_block + -(-len(seq) // block_size)))
        next_block += len(blocks)
        ids += seq
        positions += range(len(seq))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(len(seq))]
        starts.append(starts[-1] + len(seq))
        lens.append(len(seq))
        tables.append(blocks)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=0, block_size=block_size)
    return torch.tensor(ids), torch.tensor(positions), meta, next_block


def forward_logits(forward, hf_config, sequences):
    ids, positions, meta, num_blocks = flat_batch(sequences)
    cache = KVCache(Card(torch.device("cpu")), hf_config, num_blocks, 16, torch.float32)
    return forward.compute_logits(forward.forward(ids, positions, cache.kv_caches, meta))


def test_an_adapter_in_a_slot_gives_peft_merged_logits_and_a_mixed_batch_its_own(tmp_path):
    """Tiny random Llama, two peft adapters (ranks 4 and 8, one of them on
    q and v only), max_lora_rank 8: each adapter alone gives its merged
    model's logits; one batch of base, adapter 1 and adapter 2 gives each
    sequence the same logits as alone."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(TINY_LLAMA, dtype=torch.float32).eval()
    merged = {1: peft_adapter(base, tmp_path / "a1", 4, 8, seed=1),
              2: peft_adapter(base, tmp_path / "a2", 8, 16, seed=2, targets=("q_proj", "v_proj"))}
    forward = build_forward(copy.deepcopy(base))
    manager = LoRAModelManager(forward, torch.float32, max_loras=2, max_lora_rank=8,
                               max_cpu_loras=2)
    from common.lora.request import LoRARequest
    for lora_id in (1, 2):
        manager.add_adapter(LoRARequest(f"a{lora_id}", lora_id, str(tmp_path / f"a{lora_id}")))
    seqs = [torch.randint(0, 1000, (n,)).tolist() for n in (21, 17, 30)]
    with torch.no_grad():
        alone = {0: base(torch.tensor([seqs[0]])).logits[0],
                 1: merged[1](torch.tensor([seqs[1]])).logits[0],
                 2: merged[2](torch.tensor([seqs[2]])).logits[0]}
    assert not torch.allclose(alone[1], base(torch.tensor([seqs[1]])).logits[0], atol=1e-2)
    manager.set_active_adapters({1, 2})
    manager.set_mapping([0] * 21 + [1] * 17 + [2] * 30, torch.device("cpu"))
    mixed = forward_logits(forward, TINY_LLAMA, seqs).split([21, 17, 30])
    for lora_id in (0, 1, 2):
        torch.testing.assert_close(mixed[lora_id], alone[lora_id], atol=1e-4, rtol=1e-4)


def test_a_rank_above_max_lora_rank_is_refused_with_vllms_words(tmp_path):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(TINY_LLAMA, dtype=torch.float32).eval()
    peft_adapter(base, tmp_path / "a", 16, 16, seed=3)
    with pytest.raises(LoRALoadError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        LoRAModel.from_local_checkpoint(tmp_path / "a", 1, max_lora_rank=8)
    with pytest.raises(LoRALoadError, match="No adapter found"):
        LoRAModel.from_local_checkpoint(tmp_path / "missing", 1, max_lora_rank=8)


def test_the_engine_serves_each_adapter_as_hf_on_peft_merged_and_mixes_them(embedded, tmp_path):
    """The embedded model, float32, two seeded random peft adapters: the
    base model's, adapter 1's and adapter 2's greedy tokens in one batch,
    each equal to HF `generate` on the base model or on peft's merged one."""
    from common.entrypoints.llm import LLM
    from common.loader import apply_chat_template
    from common.lora.request import LoRARequest
    from common.sampling_params import SamplingParams
    from tests.conftest import PROMPTS, hf_greedy
    merged = [embedded.model,
              peft_adapter(embedded.model, tmp_path / "a1", 8, 16, seed=1),
              peft_adapter(embedded.model, tmp_path / "a2", 4, 8, seed=2,
                           targets=("q_proj", "v_proj", "down_proj"))]
    loras = [None, LoRARequest("a1", 1, str(tmp_path / "a1")),
             LoRARequest("a2", 2, str(tmp_path / "a2"))]
    prompts = [apply_chat_template(embedded.tokenizer, PROMPTS[i]) for i in range(3)]
    expected = [hf_greedy(model, ids, 12) for model, ids in zip(merged, prompts)]
    assert expected[1] != hf_greedy(embedded.model, prompts[1], 12), "adapter 1 changes nothing"
    llm = LLM(loaded=embedded, chapter="10", enable_lora=True, max_loras=2, max_lora_rank=8,
              device_memory_gb=2.0)
    params = SamplingParams(temperature=0, max_tokens=12)
    outputs = llm.generate(prompts * 2, params, use_tqdm=False, lora_request=loras + loras[::-1])
    got = [o.outputs[0].token_ids for o in outputs]
    # the first three: base, a1, a2; then the same prompts with a2, a1, base:
    # prompt 1 with adapter 1 again, in another mix
    assert got[:3] == expected
    assert got[4] == expected[1]
    alone = llm.generate([prompts[1]], params, use_tqdm=False, lora_request=loras[1])
    assert alone[0].outputs[0].token_ids == expected[1]


def test_a_step_holds_at_most_max_loras_adapters_and_the_base_model_goes_ahead(embedded,
                                                                             tmp_path):
    """max_loras 1, requests for adapter 1, adapter 2, the base model: adapter
    2's waits while adapter 1's runs, the base model's does not wait."""
    from common.entrypoints.llm import LLM
    from common.lora.request import LoRARequest
    from tests.engine_helpers import greedy
    for lora_id in (1, 2):
        peft_adapter(embedded.model, tmp_path / f"a{lora_id}", 4, 8, seed=lora_id)
    llm = LLM(loaded=embedded, chapter="10", enable_lora=True, max_loras=1, max_lora_rank=8,
              device_memory_gb=2.0)
    engine = llm.engine
    for request_id, lora_id in (("one", 1), ("two", 2), ("base", 0)):
        lora = LoRARequest(f"a{lora_id}", lora_id, str(tmp_path / f"a{lora_id}")) \
            if lora_id else None
        engine.add_request(request_id, [1, 2, 3, 4], greedy(6, ignore_eos=True),
                           lora_request=lora)
    engine.step()
    running = {seq.request_id for seq in engine.scheduler.running}
    assert running == {"one", "base"}, running  # "two" waits, "base" went past it
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["two"]
    while engine.has_unfinished_requests():
        engine.step()
        assert len({seq.lora_int_id for seq in engine.scheduler.running} - {0}) <= 1


def test_the_same_prompt_under_two_adapters_shares_no_kv_block():
    """Prefix caching keys a block by its adapter too (the first block's
    parent hash is the adapter's id): the base model's and adapter 1's
    blocks stay apart; a second request of adapter 1 finds adapter 1's."""
    from common.core.block_manager import BlockManager
    from common.core.sequence import Sequence
    from common.sampling_params import SamplingParams
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 113))  # 3 full blocks and one token
    seqs = [Sequence(str(i), prompt, SamplingParams(), lora_int_id=lora)
            for i, lora in enumerate((0, 1, 1))]
    for seq in seqs:
        bm.allocate(seq)
        seq.num_computed_tokens = len(prompt)
        bm.cache_full_blocks(seq)
    assert not set(seqs[0].block_table) & set(seqs[1].block_table)
    assert seqs[2].block_table[:3] == seqs[1].block_table[:3]
    assert seqs[2].num_cached_tokens == 12
