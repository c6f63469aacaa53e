"""ModelRunner (ch03-08): scheduled sequences -> tensors -> model -> sampled tokens.

For each step it builds the flat batch: `input_ids` and `positions` of every
new token, `slot_mapping` (where each token's K/V go), `block_tables` and
`context_lens` (what each sequence attends to), `query_start_loc` (where each
sequence's tokens start). Decode sequences (one new token) go first so that
attention can batch them. Only the last token of a sequence that is ready
to sample goes through the LM head; and (ch06) the prompt tokens of a
request that asked for `prompt_logprobs`: each position's logits give the
logprob of the prompt token after it, collected on the sequence chunk by
chunk (vLLM computes them the same way, a chunk's rows at once).

CUDA graphs of decode steps on a GPU: common/worker/cuda_graphs.py (ch05).

Two components are swapped in at construction (chapter 07), never
branched on here: the sampling step (`PlainSampling`, one token per
sampling sequence; chapter 07's `SpeculativeSampling` checks drafts,
common/spec_decode/speculative.py) and the logits processors applied before
it (chapter 07's grammar masks, common/structured_output/manager.py).
Each `ScheduledSeq` says which tokens it feeds (`input_token_ids`) and
how many of its rows go through the LM head (`num_logits_rows`).

ch08, tensor parallelism: the step's inputs are first built as plain lists
(`StepInputs`), which rank 0 sends to the other ranks
(common/worker/tp_workers.py); every rank's `Worker` (worker.py) then runs
`forward_logits` on them, and only rank 0 gets logits and samples.

Left out: async scheduling (preparing step n+1 while step n runs), graphs
of prefill steps, CUDA graphs together with tensor parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from common.worker.cuda_graphs import DecodeGraphs
from common.worker.kv_cache import KVCache
from common.core.scheduler import ScheduledSeq
from common.core.sequence import Sequence
from common.layers.attention import AttentionMetadata
from common.layers.cascade_attention import num_common_prefix_blocks
from common.layers.sampler import SampledToken, Sampler, SamplingFailed, prompt_token_logprobs

SampledTokens = dict[Sequence, list[SampledToken] | SamplingFailed]


class LogitsProcessor(Protocol):
    """Changes the logits of a step's sampling rows in place, before the
    sampler (ch07: a grammar's mask)."""

    def apply(self, logits: torch.Tensor, sampling: list[ScheduledSeq],
              rows: list[range]) -> None: ...


class PlainSampling:
    """The sampling step of chapters 03-06: one token per sampling
    sequence, its one row through chapter 03's `Sampler`."""

    def __init__(self):
        self.sampler = Sampler()

    def __call__(self, logits: torch.Tensor, sampling: list[ScheduledSeq],
                 rows: list[range] | None = None) -> SampledTokens:
        """logits: (len(sampling), vocab), one row per sequence."""
        tokens = self.sampler(logits, [item.seq.sampling for item in sampling])
        return {item.seq: token if isinstance(token, SamplingFailed) else [token]
                for item, token in zip(sampling, tokens)}


@dataclass
class StepInputs:
    """One step's inputs, as plain lists (cheap to send to other ranks, ch08)."""
    input_ids: list[int]  # (num_tokens,)
    positions: list[int]  # (num_tokens,)
    slot_mapping: list[int]  # (num_tokens,)
    query_start_loc: list[int]  # (num_seqs + 1,)
    context_lens: list[int]  # (num_seqs,)
    block_tables: list[list[int]]  # (num_seqs, max_blocks), padded with 0
    num_decodes: int
    block_size: int
    sample_rows: list[int]  # rows of the hidden states that go through the LM head
    prompt_logprob_rows: list[int]  # ch06: more rows through it, for prompt logprobs
    num_common_prefix_blocks: int = 0  # ch05: the decodes' shared blocks (cascade attention)
    token_lora_ids: list[int] = field(default_factory=list)  # ch10: each token's adapter, 0: none

    def to_tensors(self, device: torch.device):
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        meta = AttentionMetadata(
            slot_mapping=tensor(self.slot_mapping, torch.long),  # (num_tokens,)
            query_start_loc=tensor(self.query_start_loc, torch.int32),  # (num_seqs + 1,)
            context_lens=tensor(self.context_lens, torch.int32),  # (num_seqs,)
            block_tables=tensor(self.block_tables, torch.int32),  # (num_seqs, max_blocks)
            num_decodes=self.num_decodes, block_size=self.block_size,
            num_common_prefix_blocks=self.num_common_prefix_blocks)
        return tensor(self.input_ids, torch.long), tensor(self.positions, torch.long), meta


class NoAdapters:
    """Chapters 03-09: every token runs the base model. Chapter 10 plugs in
    common/lora/model_manager.py's `LoRAModelManager` instead."""

    def prepare(self, token_lora_ids: list[int], device: torch.device) -> None:
        pass

    def add_adapter(self, request) -> None:
        raise ValueError(f"adapter {request.lora_name!r}: LoRA is not enabled (--enable-lora)")


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, workers=None,
                 sampling: "PlainSampling | None" = None,
                 logits_processors: tuple[LogitsProcessor, ...] = (),
                 cascade_attention: bool = False, adapters=None):
        """`model`: the forward pass (common.models.build_forward), on this
        rank's share of the weights. `workers` (ch08): on rank 0 the other
        ranks (tp_workers.TPWorkers), which run every step too. `sampling`
        and `logits_processors`: the chapter's sampling step and what
        changes the logits before it (common/engine/parts.py).
        `cascade_attention` (ch05): look for the decodes' shared prefix at
        every step (common/layers/cascade_attention.py). `adapters` (ch10):
        the LoRA slots, told before each forward pass which token runs with
        which adapter (default: none, `NoAdapters`)."""
        self.model = model
        self.workers = workers
        self.graphs: DecodeGraphs | None = None  # ch05 on CUDA: capture_decode_graphs()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = next(model.hf.parameters()).device
        self.sampling = sampling or PlainSampling()  # ch07: SpeculativeSampling with drafts
        self.logits_processors = tuple(logits_processors)  # ch07: the grammar's masks
        self.cascade_attention = cascade_attention  # ch05
        self.adapters = adapters or NoAdapters()  # ch10

    def prepare_inputs(self, batch: list[ScheduledSeq]) -> StepInputs:
        """The batch's inputs as lists. `batch` must list decodes (1 token) first."""
        input_ids, positions, slots, query_start, context_lens = [], [], [], [0], []
        sample_rows, prompt_rows, token_lora_ids = [], [], []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += item.input_token_ids()
            for pos in range(start, end):
                slots.append(seq.block_table[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
            positions += range(start, end)
            token_lora_ids += [seq.lora_int_id] * item.num_new_tokens  # ch10
            query_start.append(query_start[-1] + item.num_new_tokens)
            context_lens.append(end)
            sample_rows += range(query_start[-1] - item.num_logits_rows, query_start[-1])
            first_row = query_start[-2] - start  # the row of position `start`, minus start
            prompt_rows += [first_row + p for p in seq.prompt_logprob_positions(start, end)]
        max_blocks = max(len(item.seq.block_table) for item in batch)
        tables = [item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table))
                  for item in batch]
        num_decodes = sum(1 for item in batch if item.num_new_tokens == 1)
        common = 0
        if self.cascade_attention:  # ch05: the blocks every decode begins with
            common = num_common_prefix_blocks(tables[:num_decodes], context_lens[:num_decodes],
                                              self.block_size)
        return StepInputs(
            input_ids, positions, slots, query_start, context_lens, tables,
            num_decodes=num_decodes, block_size=self.block_size, sample_rows=sample_rows,
            prompt_logprob_rows=prompt_rows, num_common_prefix_blocks=common,
            token_lora_ids=token_lora_ids)

    @torch.inference_mode()
    def forward_logits(self, step: StepInputs) -> torch.Tensor | None:
        """The forward pass and the LM head; every rank runs it (ch08).
        Returns the logits (num_sampling + num_prompt_logprob_rows, vocab),
        or None where this step samples nothing, and on ranks other than 0."""
        input_ids, positions, meta = step.to_tensors(self.device)
        self.adapters.prepare(step.token_lora_ids, self.device)  # ch10: the adapters' slots
        if self.graphs is not None and self.graphs.can_run(len(step.context_lens),
                                                           step.num_decodes):
            hidden = self.graphs.run(input_ids, positions, meta)  # ch05: a CUDA graph replay
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_cache.kv_caches, meta)
        rows = step.sample_rows + step.prompt_logprob_rows
        if not rows:
            return None
        rows = torch.tensor(rows, device=self.device)
        return self.model.compute_logits(hidden[rows])  # (num_rows, vocab)

    @torch.inference_mode()  # no_grad, and no autograd bookkeeping per tensor either
    def execute_model(self, batch: list[ScheduledSeq]) -> SampledTokens:
        """One forward pass. Returns the new tokens of each sequence that
        samples this step (one; chapter 07, with drafts, the accepted ones
        and one more); a prefill chunk that is not the last has none."""
        # ch05: prefill chunks and decodes share the batch; decodes go first
        batch = sorted(batch, key=lambda item: item.num_new_tokens != 1)
        step = self.prepare_inputs(batch)
        if self.workers is not None:  # ch08: the other ranks run the same step
            logits = self.workers.execute(step, self.forward_logits)
        else:
            logits = self.forward_logits(step)
        if logits is None:
            return {}
        num_sample_rows = len(step.sample_rows)
        if step.prompt_logprob_rows:  # ch06
            self.collect_prompt_logprobs(batch, logits[num_sample_rows:])
        sampling = [item for item in batch if item.samples]
        if not sampling:
            return {}
        logits = logits[:num_sample_rows]
        rows = self.item_rows(sampling)
        for processor in self.logits_processors:  # ch07: structured outputs
            processor.apply(logits, sampling, rows)
        return self.sampling(logits, sampling, rows)

    @staticmethod
    def collect_prompt_logprobs(batch: list[ScheduledSeq], logits: torch.Tensor) -> None:
        """ch06: logits (num_prompt_logprob_rows, vocab), in the batch's
        order -> each asking sequence's prompt logprobs, appended."""
        start_row = 0
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            positions = seq.prompt_logprob_positions(start, start + item.num_new_tokens)
            if positions:
                rows = logits[start_row:start_row + len(positions)]
                seq.prompt_logprobs += prompt_token_logprobs(
                    rows, seq.prompt_token_ids[positions.start + 1:positions.stop + 1],
                    seq.params.prompt_logprobs)
                start_row += len(positions)

    @staticmethod
    def item_rows(sampling: list[ScheduledSeq]) -> list[range]:
        """Each sampling sequence's rows of the logits: one, or ch07 k + 1."""
        rows, start = [], 0
        for item in sampling:
            rows.append(range(start, start + item.num_logits_rows))
            start += item.num_logits_rows
        return rows

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """ch05 on CUDA: record decode steps as CUDA graphs (cuda_graphs.py)."""
        self.graphs = DecodeGraphs(self.model, self.kv_cache.kv_caches, max_num_seqs,
                                   -(-max_model_len // self.block_size), self.block_size,
                                   self.device)
        self.graphs.capture()
