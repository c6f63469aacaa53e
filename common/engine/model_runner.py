"""ModelRunner (ch03-06): scheduled sequences -> tensors -> model -> sampled tokens.

For each step it builds the flat batch: `input_ids` and `positions` of every
new token, `slot_mapping` (where each token's K/V go), `block_tables` and
`context_lens` (what each sequence attends to), `query_start_loc` (where each
sequence's tokens start). Decode sequences (one new token) go first so that
attention can batch them. Only the last token of a sequence that is ready
to sample goes through the LM head.

CUDA graphs of decode steps on a GPU: common/engine/cuda_graphs.py (ch05).

ch06, structured outputs: the rows of constrained sequences get their
grammar's token mask (-inf for every disallowed token) before the sampler.
ch06, speculative decoding: a sequence checking k drafts feeds them after
its last token, like a short prefill chunk over its cached context, and
all its k + 1 rows go through the LM head; the `RejectionSampler`
(common/layers/rejection_sampler.py) then keeps the drafts the model
agrees with, plus one token.

ch06, tensor parallelism: the step's inputs are first built as plain lists
(`StepInputs`), which rank 0 sends to the other ranks
(common/engine/tp_workers.py); every rank's `Worker` (worker.py) then runs
`forward_logits` on them, and only rank 0 gets logits and samples.

Left out: async scheduling (preparing step n+1 while step n runs), graphs
of prefill steps, CUDA graphs together with tensor parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.cuda_graphs import DecodeGraphs
from common.engine.kv_cache import KVCache
from common.engine.scheduler import ScheduledSeq
from common.engine.sequence import Sequence
from common.layers.attention import AttentionMetadata
from common.layers.rejection_sampler import RejectionSampler
from common.layers.sampler import SampledToken, Sampler, SamplingFailed
from common.layers.token_bitmask import allocate_token_bitmask, apply_token_bitmask


@dataclass
class StepInputs:
    """One step's inputs, as plain lists (cheap to send to other ranks, ch06)."""
    input_ids: list[int]  # (num_tokens,)
    positions: list[int]  # (num_tokens,)
    slot_mapping: list[int]  # (num_tokens,)
    query_start_loc: list[int]  # (num_seqs + 1,)
    context_lens: list[int]  # (num_seqs,)
    block_tables: list[list[int]]  # (num_seqs, max_blocks), padded with 0
    num_decodes: int
    block_size: int
    sample_rows: list[int]  # rows of the hidden states that go through the LM head

    def to_tensors(self, device: torch.device):
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        meta = AttentionMetadata(
            slot_mapping=tensor(self.slot_mapping, torch.long),  # (num_tokens,)
            query_start_loc=tensor(self.query_start_loc, torch.int32),  # (num_seqs + 1,)
            context_lens=tensor(self.context_lens, torch.int32),  # (num_seqs,)
            block_tables=tensor(self.block_tables, torch.int32),  # (num_seqs, max_blocks)
            num_decodes=self.num_decodes, block_size=self.block_size)
        return tensor(self.input_ids, torch.long), tensor(self.positions, torch.long), meta


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, workers=None):
        """`model`: the forward pass (common.models.build_forward), on this
        rank's share of the weights. `workers` (ch06): on rank 0 the other
        ranks (tp_workers.TPWorkers), which run every step too."""
        self.model = model
        self.workers = workers
        self.graphs: DecodeGraphs | None = None  # ch05 on CUDA: capture_decode_graphs()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = next(model.hf.parameters()).device
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()  # ch06: speculative decoding

    def prepare_inputs(self, batch: list[ScheduledSeq]) -> StepInputs:
        """The batch's inputs as lists. `batch` must list decodes (1 token) first."""
        input_ids, positions, slots, query_start, context_lens = [], [], [], [0], []
        sample_rows = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += seq.token_ids[start:end] + item.draft_token_ids  # ch06: drafts last
            for pos in range(start, end):
                slots.append(seq.block_table[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
            positions += range(start, end)
            query_start.append(query_start[-1] + item.num_new_tokens)
            context_lens.append(end)
            if item.samples:  # the last token's row, and ch06 one row per draft
                sample_rows += range(query_start[-1] - 1 - len(item.draft_token_ids),
                                     query_start[-1])
        max_blocks = max(len(item.seq.block_table) for item in batch)
        tables = [item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table))
                  for item in batch]
        return StepInputs(
            input_ids, positions, slots, query_start, context_lens, tables,
            num_decodes=sum(1 for item in batch if item.num_new_tokens == 1),
            block_size=self.block_size, sample_rows=sample_rows)

    @torch.inference_mode()
    def forward_logits(self, step: StepInputs) -> torch.Tensor | None:
        """The forward pass and the LM head; every rank runs it (ch06).
        Returns the logits (num_sampling, vocab), or None where this step
        samples nothing, and on ranks other than 0."""
        input_ids, positions, meta = step.to_tensors(self.device)
        if self.graphs is not None and self.graphs.can_run(len(step.context_lens),
                                                           step.num_decodes):
            hidden = self.graphs.run(input_ids, positions, meta)  # ch05: a CUDA graph replay
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_cache.kv_caches, meta)
        if not step.sample_rows:
            return None
        last_rows = torch.tensor(step.sample_rows, device=self.device)
        return self.model.compute_logits(hidden[last_rows])  # (num_sampling, vocab)

    @torch.inference_mode()  # no_grad, and no autograd bookkeeping per tensor either
    def execute_model(self, batch: list[ScheduledSeq]
                      ) -> dict[Sequence, list[SampledToken] | SamplingFailed]:
        """One forward pass. Returns the new tokens of each sequence that
        samples this step (one; ch06, with drafts, the accepted ones and one
        more); a prefill chunk that is not the last has none."""
        # ch05: prefill chunks and decodes share the batch; decodes go first
        batch = sorted(batch, key=lambda item: item.num_new_tokens != 1)
        step = self.prepare_inputs(batch)
        if self.workers is not None:  # ch06: the other ranks run the same step
            logits = self.workers.execute(step, self.forward_logits)
        else:
            logits = self.forward_logits(step)
        if logits is None:
            return {}
        sampling = [item for item in batch if item.samples]
        rows = self.item_rows(sampling)
        self.apply_grammar_masks(logits, sampling, rows)  # ch06: structured outputs
        plain = [(item, r) for item, r in zip(sampling, rows) if not item.draft_token_ids]
        speculating = [(item, r) for item, r in zip(sampling, rows) if item.draft_token_ids]
        results: dict[Sequence, list[SampledToken] | SamplingFailed] = {}
        if plain:
            plain_logits = logits if not speculating else logits[[r[0] for _, r in plain]]
            tokens = self.sampler(plain_logits, [item.seq.sampling for item, _ in plain])
            for (item, _), token in zip(plain, tokens):
                results[item.seq] = token if isinstance(token, SamplingFailed) else [token]
        if speculating:  # ch06: every draft row, in one call
            verified = self.rejection_sampler(
                logits[[row for _, r in speculating for row in r]],
                [item.seq.sampling for item, _ in speculating],
                [item.draft_token_ids for item, _ in speculating])
            results.update(zip((item.seq for item, _ in speculating), verified))
        return results

    @staticmethod
    def item_rows(sampling: list[ScheduledSeq]) -> list[range]:
        """Each sampling sequence's rows of the logits: one, or ch06 k + 1."""
        rows, start = [], 0
        for item in sampling:
            rows.append(range(start, start + 1 + len(item.draft_token_ids)))
            start += 1 + len(item.draft_token_ids)
        return rows

    @staticmethod
    def apply_grammar_masks(logits: torch.Tensor, sampling: list[ScheduledSeq],
                            rows: list[range]) -> None:
        """ch06: each constrained sequence's rows get its grammar's mask
        (-inf for the tokens it does not allow); the other rows are untouched."""
        constrained = [(item, r) for item, r in zip(sampling, rows)
                       if item.seq.structured_output is not None]
        if not constrained:
            return
        row_ids = [row for _, r in constrained for row in r]
        bitmask = allocate_token_bitmask(len(row_ids), logits.shape[-1])  # (rows, words)
        first = 0
        for item, r in constrained:
            item.seq.structured_output.fill_bitmask_rows(bitmask, first, item.draft_token_ids)
            first += len(r)
        masked = logits[row_ids]  # (rows, vocab), a copy
        apply_token_bitmask(masked, bitmask.to(logits.device))
        logits[row_ids] = masked

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """ch05 on CUDA: record decode steps as CUDA graphs (cuda_graphs.py)."""
        self.graphs = DecodeGraphs(self.model, self.kv_cache.kv_caches, max_num_seqs,
                                   -(-max_model_len // self.block_size), self.block_size,
                                   self.device)
        self.graphs.capture()
