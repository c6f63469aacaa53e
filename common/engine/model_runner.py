"""ModelRunner (ch03-05): scheduled sequences -> tensors -> model -> sampled tokens.

For each step it builds the flat batch: `input_ids` and `positions` of every
new token, `slot_mapping` (where each token's K/V go), `block_tables` and
`context_lens` (what each sequence attends to), `query_start_loc` (where each
sequence's tokens start). Decode sequences (one new token) go first so that
attention can batch them. Only the last token of a sequence that is ready
to sample goes through the LM head.

CUDA graphs of decode steps on a GPU: common/engine/cuda_graphs.py (ch05).

Left out: async scheduling (preparing step n+1 while step n runs), graphs
of prefill steps.
"""
from __future__ import annotations

import torch

from common.engine.cuda_graphs import DecodeGraphs
from common.engine.kv_cache import KVCache
from common.engine.scheduler import ScheduledSeq
from common.engine.sequence import Sequence
from common.layers.attention import AttentionMetadata
from common.layers.sampler import SampledToken, Sampler, SamplingFailed
from common.models import build_forward


class ModelRunner:
    def __init__(self, hf_model, kv_cache: KVCache, eos_token_ids: set[int],
                 attention_ops=None):
        self.model = build_forward(hf_model, attention_ops)
        self.graphs: DecodeGraphs | None = None  # ch05 on CUDA: capture_decode_graphs()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = next(hf_model.parameters()).device
        self.eos_token_ids = sorted(eos_token_ids)
        self.sampler = Sampler()

    def prepare(self, batch: list[ScheduledSeq]):
        """The batch's tensors. `batch` must list decodes (1 token) first."""
        input_ids, positions, slots, query_start, context_lens = [], [], [], [0], []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += seq.token_ids[start:end]
            for pos in range(start, end):
                slots.append(seq.block_table[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
            positions += range(start, end)
            query_start.append(query_start[-1] + item.num_new_tokens)
            context_lens.append(end)
        max_blocks = max(len(item.seq.block_table) for item in batch)
        tables = [item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table))
                  for item in batch]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.long),  # (num_tokens,)
            query_start_loc=tensor(query_start, torch.int32),  # (num_seqs + 1,)
            context_lens=tensor(context_lens, torch.int32),  # (num_seqs,)
            block_tables=tensor(tables, torch.int32),  # (num_seqs, max_blocks)
            num_decodes=sum(1 for item in batch if item.num_new_tokens == 1),
            block_size=self.block_size)
        return tensor(input_ids, torch.long), tensor(positions, torch.long), meta

    @torch.inference_mode()  # no_grad, and no autograd bookkeeping per tensor either
    def run(self, batch: list[ScheduledSeq]) -> dict[Sequence, SampledToken | SamplingFailed]:
        """One forward pass. Returns the new token of each sequence that
        samples this step (a prefill chunk that is not the last has none)."""
        # ch05: prefill chunks and decodes share the batch; decodes go first
        batch = sorted(batch, key=lambda item: item.num_new_tokens != 1)
        input_ids, positions, meta = self.prepare(batch)
        if self.graphs is not None and self.graphs.can_run(len(batch), meta.num_decodes):
            hidden = self.graphs.run(input_ids, positions, meta)  # ch05: a CUDA graph replay
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_cache.kv_caches, meta)
        sampling = [i for i, item in enumerate(batch) if item.samples]
        if not sampling:
            return {}
        last_rows = meta.query_start_loc[1:].long()[sampling] - 1
        logits = self.model.compute_logits(hidden[last_rows])  # (num_sampling, vocab)
        seqs = [batch[i].seq for i in sampling]
        sampled = self.sampler(
            logits, [s.params for s in seqs], [s.generator for s in seqs],
            [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
            banned=[self._banned(s) for s in seqs])
        return dict(zip(seqs, sampled))

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """ch05 on CUDA: record decode steps as CUDA graphs (cuda_graphs.py)."""
        self.graphs = DecodeGraphs(self.model, self.kv_cache.kv_caches, max_num_seqs,
                                   -(-max_model_len // self.block_size), self.block_size,
                                   self.device)
        self.graphs.capture()

    def _banned(self, seq) -> list[int]:
        """EOS may not be picked before min_tokens."""
        if seq.num_output_tokens < seq.params.min_tokens and not seq.params.ignore_eos:
            return self.eos_token_ids + list(seq.params.stop_token_ids)
        return []
