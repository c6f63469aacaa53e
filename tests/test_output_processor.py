"""The output processor alone, with a fake tokenizer and no model (as the
scheduler's unit tests): stop strings across token boundaries, the text
held back, deltas and final-only outputs."""
from __future__ import annotations

import pytest

from common.engine.output_processor import OutputProcessor
from common.core.sequence import Sequence
from common.layers.sampler import SampledToken
from common.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.ch05


class PieceTokenizer:
    """Token id i decodes to PIECES[i]; a sequence to their concatenation."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


PIECES = ["Hel", "lo Wo", "rld", "!", " and", " more"]


def run(params: SamplingParams, tokens: list[int], finish_last_as: str = "length"):
    """Feed `tokens` one step at a time; the last one finishes the sequence
    (as the scheduler would, by length) unless a stop string ends it first.
    Returns the outputs and the reasons the processor finished it for."""
    processor = OutputProcessor(PieceTokenizer(PIECES))
    seq = Sequence("r", [0], params)
    processor.add(seq)
    outputs, finished_by_processor = [], []
    for k, token in enumerate(tokens):
        seq.append(SampledToken(token))
        if k == len(tokens) - 1:
            seq.finish_reason = finish_last_as
        new, to_finish = processor.process([seq])
        outputs += [o.outputs[0] for o in new]
        finished_by_processor += [f.reason for f in to_finish]
        if to_finish:
            break
    return outputs, finished_by_processor


def test_a_stop_string_across_token_boundaries_is_cut_and_never_sent():
    outputs, finished = run(SamplingParams(stop=["o Wor"], output_kind=RequestOutputKind.DELTA),
                            [0, 1, 2, 3])
    texts = [o.text for o in outputs]
    assert finished == ["stop"] and outputs[-1].finish_reason == "stop"
    assert "".join(texts) == "Hell"  # "Hello World!" cut before the stop string
    assert not any("o" in t and "W" in t for t in texts)  # no part of it leaked
    assert len(outputs) == 3  # the stop matched at the third token


def test_text_that_could_start_a_stop_string_is_held_back_then_released():
    """stop "XYZ": the last 2 characters of each step are held (they could
    begin it); at the end, by length, everything held is released."""
    outputs, finished = run(SamplingParams(stop=["XYZ"], output_kind=RequestOutputKind.DELTA),
                            [0, 1, 2, 3])
    texts = [o.text for o in outputs]
    assert finished == [] and outputs[-1].finish_reason == "length"
    assert texts == ["H", "ello ", "Wor", "ld!"]  # each step holds back 2 characters
    assert "".join(texts) == "Hello World!"


def test_deltas_carry_each_steps_token_and_final_only_the_whole_answer_once():
    deltas, _ = run(SamplingParams(output_kind=RequestOutputKind.DELTA), [0, 1, 4])
    assert [o.token_ids for o in deltas] == [[0], [1], [4]]
    assert [o.finished for o in deltas] == [False, False, True]
    final, _ = run(SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY), [0, 1, 4, 5])
    assert len(final) == 1 and final[0].finished
    assert final[0].text == "Hello Wo and more" and final[0].token_ids == [0, 1, 4, 5]
    assert final[0].num_output_tokens == 4
