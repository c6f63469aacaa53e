"""CUDA graphs of decode steps (ch05): the padding of the static inputs
(checked on the CPU), and graphed == eager (on CUDA only)."""
from __future__ import annotations

import pytest
import torch

from common.worker.cuda_graphs import DecodeInputs, graph_batch_size
from common.layers.attention import AttentionMetadata
from tests.engine_helpers import greedy, make_engine, run_all

pytestmark = pytest.mark.ch05


def test_a_batch_is_padded_up_to_the_next_captured_size():
    sizes = [1, 2, 4, 8, 16, 32]
    assert [graph_batch_size(n, sizes) for n in (1, 3, 8, 9, 32)] == [1, 4, 8, 16, 32]
    assert graph_batch_size(33, sizes) is None  # too big: the step runs eagerly


def test_the_static_inputs_hold_the_step_then_harmless_padding():
    buffers = DecodeInputs(max_seqs=8, max_blocks=4, block_size=16, device="cpu")
    buffers.slot_mapping.fill_(99)  # what an earlier, larger step left there
    buffers.block_tables.fill_(7)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([33, 70, 5]), query_start_loc=torch.arange(4),
        context_lens=torch.tensor([34, 71, 6], dtype=torch.int32),
        block_tables=torch.tensor([[2, 1], [3, 4], [0, 0]], dtype=torch.int32),
        num_decodes=3, block_size=16)
    buffers.load(torch.tensor([11, 12, 13]), torch.tensor([33, 70, 5]), meta, size=4)
    view = buffers.metadata(4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert view.slot_mapping.tolist() == [33, 70, 5, -1]  # -1: the padding row writes nothing
    assert view.context_lens.tolist() == [34, 71, 6, 1]
    assert view.block_tables.tolist() == [[2, 1, 0, 0], [3, 4, 0, 0], [0, 0, 0, 0],
                                          [0, 0, 0, 0]]
    assert view.num_decodes == 4 and view.query_start_loc.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_decode_equals_eager_on_cuda():
    from common.loader import load_model
    loaded = load_model("tiny-llama", dtype="float32", device="cuda", load_format="dummy")
    prompts = {str(i): [1 + (7 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(5)}
    eager = run_all(make_engine(loaded, num_blocks=64, enforce_eager=True), prompts,
                    greedy(24, ignore_eos=True))
    graphed_engine = make_engine(loaded, num_blocks=64)
    assert graphed_engine.worker.model_runner.graphs is not None
    graphed = run_all(graphed_engine, prompts, greedy(24, ignore_eos=True))
    assert {k: v.token_ids for k, v in graphed.items()} == {
        k: v.token_ids for k, v in eager.items()}
