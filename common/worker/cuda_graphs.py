"""CUDA graphs for decode steps (ch05, what a GPU adds; CUDA only).

A decode step of a small model is hundreds of tiny kernel launches (a few
per layer and per operation), and on a fast GPU launching them costs more
than running them. A CUDA graph records the launches of one forward pass
once, then replays them with a single call.

A graph replays the same kernels on the same memory, so:

- it is captured per batch size (`GRAPH_BATCH_SIZES`), and a step's batch
  is padded up to the next captured size;
- its inputs live in static buffers: `input_ids`, `positions`,
  `slot_mapping`, `context_lens` and `block_tables` of the largest size;
  a step copies its tensors into their first rows. Padding rows write
  their K/V to slot -1, which the Triton store kernel skips, and attend
  over one position of block 0 (their outputs are dropped);
- only decode steps are graphed: every sequence has exactly one new
  token, so the shapes depend on the batch size alone. A prefill's shapes
  depend on every prompt's length (too many graphs); it runs eagerly, as
  in vLLM and nano-vllm.

Nothing in the forward pass may synchronize with the host (no `.item()`,
`.tolist()`, `int(tensor)`): the Triton decode kernel reads `context_lens`
on the GPU; the PyTorch reference needs the longest context on the host,
so graphs need the Triton kernels, hence CUDA. `--enforce-eager` turns
graphs off (vLLM's name); on the CPU they are always off.

Left out: graphs of mixed prefill+decode batches (vLLM's piecewise graphs),
sampling inside the graph.
"""
from __future__ import annotations

import logging

import torch

from common.layers.attention import AttentionMetadata

log = logging.getLogger("llm-course")

GRAPH_BATCH_SIZES = [1, 2, 4, 8] + list(range(16, 513, 16))


def graph_batch_size(num_seqs: int, captured: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs`, or None."""
    return next((size for size in captured if size >= num_seqs), None)


class DecodeInputs:
    """The static buffers a graph reads, for up to `max_seqs` sequences."""

    def __init__(self, max_seqs: int, max_blocks: int, block_size: int, device):
        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.block_size = block_size
        self.input_ids = zeros(max_seqs, dtype=torch.long)  # (max_seqs,)
        self.positions = zeros(max_seqs, dtype=torch.long)
        self.slot_mapping = zeros(max_seqs, dtype=torch.long)
        self.context_lens = zeros(max_seqs, dtype=torch.int32)
        self.block_tables = zeros(max_seqs, max_blocks, dtype=torch.int32)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)

    def metadata(self, size: int) -> AttentionMetadata:
        """Views of the first `size` rows: what the graph of that size reads."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            context_lens=self.context_lens[:size], block_tables=self.block_tables[:size],
            num_decodes=size, block_size=self.block_size)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata, size: int) -> None:
        """Copy one decode step's inputs into the buffers, padded to `size`."""
        n, width = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:].zero_()
        # Padding rows: no K/V written (slot -1), one position of block 0 read.
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.context_lens[n:size].fill_(1)
        self.block_tables[n:size].zero_()


class DecodeGraphs:
    """One CUDA graph of `model.forward` per batch size, and their replay."""

    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks: int,
                 block_size: int, device: torch.device):
        self.model, self.kv_caches = model, kv_caches
        self.sizes = [s for s in GRAPH_BATCH_SIZES if s <= max_num_seqs]
        if max_num_seqs not in self.sizes:
            self.sizes.append(max_num_seqs)
        self.inputs = DecodeInputs(self.sizes[-1], max_blocks, block_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # (size, hidden) per graph

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first, so the smaller graphs reuse its memory pool."""
        pool = None
        for size in reversed(self.sizes):
            meta = self.inputs.metadata(size)
            args = (self.inputs.input_ids[:size], self.inputs.positions[:size],
                    self.kv_caches, meta)
            self.inputs.slot_mapping[:size].fill_(-1)  # the warm-up writes nothing
            self.inputs.context_lens[:size].fill_(1)
            self.model.forward(*args)  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model.forward(*args)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("CUDA graphs captured for decode batches of %s sequences", self.sizes)

    def can_run(self, num_seqs: int, num_decodes: int) -> bool:
        return num_decodes == num_seqs and graph_batch_size(num_seqs, self.sizes) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """A decode step by replay. Returns hidden states (num_seqs, hidden)."""
        n = input_ids.shape[0]
        size = graph_batch_size(n, self.sizes)
        self.inputs.load(input_ids, positions, meta, size)
        self.graphs[size].replay()
        return self.outputs[size][:n]
