"""The engine's per-step figures (common/metrics/stats.py), without a model
first: the output processor driven step by step with given timestamps, as
the engine drives it; then Prometheus' `Metrics` fed an IterationStats;
then the stat loggers of a real engine (the embedded model)."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

from common.engine.output_processor import OutputProcessor
from common.core.sequence import Sequence
from common.metrics.stats import FinishedRequestStats, IterationStats
from common.entrypoints.metrics import Metrics
from common.layers.sampler import SampledToken
from common.sampling_params import RequestOutputKind, SamplingParams
from tests.engine_helpers import greedy, make_engine, run_all
from tests.test_output_processor import PIECES, PieceTokenizer

pytestmark = pytest.mark.ch06

ARRIVAL, FIRST_STEP = 100.0, 100.25
STEP_TIMES = [101.0, 101.5, 102.25, 103.0]  # each step's one timestamp (exact in binary)


def drive(kind: RequestOutputKind, tokens: list[int], times: list[float], stop=None,
          finish_last_as: str = "length"):
    """One request, one token per step at `times`, as `LLMEngine.step` does
    it: returns its outputs and each step's IterationStats."""
    processor = OutputProcessor(PieceTokenizer(PIECES))
    seq = Sequence("r", [0, 1, 2], SamplingParams(output_kind=kind, max_tokens=len(tokens),
                                                  stop=stop), arrival_time=ARRIVAL)
    processor.add(seq)
    seq.first_scheduled_time = FIRST_STEP  # the engine stamps it when it first schedules it
    outputs, steps = [], []
    for k, (token, now) in enumerate(zip(tokens, times)):
        seq.append(SampledToken(token))
        if k == len(tokens) - 1:
            seq.finish_reason = finish_last_as
        steps.append(IterationStats(now))
        new, to_finish = processor.process([seq], steps[-1])
        outputs += [o.outputs[0] for o in new]
        if to_finish:
            break
    return outputs, steps


def test_a_final_only_request_gets_one_output_and_every_latency():
    outputs, steps = drive(RequestOutputKind.FINAL_ONLY, [0, 1, 4, 5], STEP_TIMES)
    assert len(outputs) == 1 and outputs[0].finished  # one output for the client ...
    ttfts = [t for s in steps for t in s.time_to_first_tokens_iter]
    itls = [t for s in steps for t in s.inter_token_latencies_iter]
    assert ttfts == [1.0]  # ... yet each of its 4 tokens timed: arrival -> first token
    assert itls == [0.5, 0.75, 0.75]  # 4 - 1 gaps, each at its own step
    assert [s.num_generation_tokens for s in steps] == [1, 1, 1, 1]
    assert [len(s.finished_requests) for s in steps] == [0, 0, 0, 1]
    finished = steps[-1].finished_requests[0]
    assert finished == FinishedRequestStats(
        request_id="r", finish_reason="length", e2e_latency=3.0, num_prompt_tokens=3,
        num_generation_tokens=4, max_tokens_param=4,
        queued_time=0.25,  # arrival -> first step
        prefill_time=0.75,  # first step -> first token
        inference_time=2.75,  # first step -> last token
        decode_time=2.0,  # first token -> last token
        mean_time_per_output_token=pytest.approx(2.0 / 3))  # over the 3 tokens after the first


def test_the_output_kind_changes_the_outputs_not_the_figures():
    final_outputs, final = drive(RequestOutputKind.FINAL_ONLY, [0, 1, 4, 5], STEP_TIMES)
    delta_outputs, delta = drive(RequestOutputKind.DELTA, [0, 1, 4, 5], STEP_TIMES)
    assert (len(final_outputs), len(delta_outputs)) == (1, 4)
    assert [vars(s) for s in final] == [vars(s) for s in delta]


def test_a_stop_string_finishes_the_request_in_its_figures_too():
    """"Hello Wo" + "rld": the stop string "World" matches at the third token."""
    outputs, steps = drive(RequestOutputKind.FINAL_ONLY, [0, 1, 2, 3], STEP_TIMES,
                           stop=["World"])
    assert len(outputs) == 1 and outputs[0].finish_reason == "stop"
    assert len(steps) == 3 and len(steps[-1].inter_token_latencies_iter) == 1
    finished = steps[-1].finished_requests[0]
    assert finished.finish_reason == "stop" and finished.num_generation_tokens == 3
    assert finished.e2e_latency == 2.25 and finished.decode_time == 1.25


def test_a_one_token_request_has_a_ttft_no_gap_and_no_time_per_token():
    _, steps = drive(RequestOutputKind.FINAL_ONLY, [0], STEP_TIMES[:1])
    (step,) = steps
    assert step.time_to_first_tokens_iter == [1.0] and step.inter_token_latencies_iter == []
    finished = step.finished_requests[0]
    assert finished.e2e_latency == 1.0 and finished.decode_time == 0.0
    assert finished.mean_time_per_output_token == 0.0


def test_a_request_failed_before_its_first_token_or_aborted_has_no_figures():
    processor = OutputProcessor(PieceTokenizer(PIECES))
    failed, aborted = (Sequence(r, [0], SamplingParams(), arrival_time=ARRIVAL)
                       for r in ("failed", "aborted"))
    for seq in (failed, aborted):
        processor.add(seq)
        seq.first_scheduled_time = FIRST_STEP
    failed.finish_reason, failed.error = "error", "sampling failed"  # no token appended
    step = IterationStats(101.0)
    outputs, _ = processor.process([failed], step)
    processor.abort("aborted")
    assert [o.outputs[0].finish_reason for o in outputs] == ["error"]
    assert (step.time_to_first_tokens_iter, step.finished_requests) == ([], [])
    assert step.num_generation_tokens == 0


# ------------------------------------------------- Prometheus, model-free
SNAPSHOT = {"running": 0, "waiting": 0, "kv_cache_usage_perc": 0.0, "prompt_tokens": 0,
            "generation_tokens": 0, "num_preemptions": 0, "prefix_cache_queries": 0,
            "prefix_cache_hits": 0, "finished": {},
            "waiting_by_reason": {"capacity": 0, "deferred": 0},
            "prompt_tokens_by_source": {"local_compute": 0, "local_cache_hit": 0,
                                        "external_kv_transfer": 0}}


def scrape(metrics: Metrics) -> dict[str, float]:
    text = metrics.render()[0].decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_record_observes_vllms_per_request_histograms():
    _, steps = drive(RequestOutputKind.FINAL_ONLY, [0, 1, 4, 5], STEP_TIMES)
    _, one = drive(RequestOutputKind.DELTA, [0], STEP_TIMES[:1])
    metrics = Metrics(lambda: SNAPSHOT, "m", max_model_len=64)
    for step in steps + one:
        metrics.record(step)
    metrics.record_parent(2, [4, 1])
    values = scrape(metrics)

    def hist(name: str) -> tuple[float, float]:
        return (values[f'vllm:{name}_count{{model_name="m"}}'],
                values[f'vllm:{name}_sum{{model_name="m"}}'])

    assert hist("time_to_first_token_seconds") == (2, 2.0)
    assert hist("inter_token_latency_seconds") == (3, 2.0)
    assert hist("e2e_request_latency_seconds") == (2, 4.0)
    assert hist("request_queue_time_seconds") == (2, 0.5)
    assert hist("request_prefill_time_seconds") == (2, 1.5)
    assert hist("request_decode_time_seconds") == (2, 2.0)
    assert hist("request_inference_time_seconds") == (2, 3.5)
    count, total = hist("request_time_per_output_token_seconds")
    assert count == 1 and total == pytest.approx(2.0 / 3)  # not for a one-token request
    assert hist("request_prompt_tokens") == (2, 6)
    assert hist("request_generation_tokens") == (2, 5)
    assert hist("request_params_max_tokens") == (2, 5)
    assert hist("request_params_n") == (1, 2)
    assert hist("request_max_num_generation_tokens") == (1, 4)
    assert hist("request_num_preemptions") == (2, 0)


# ------------------------------------------------ the engine's stat loggers
class Recorder:
    def __init__(self):
        self.steps: list[IterationStats] = []

    def record(self, iteration_stats: IterationStats) -> None:
        self.steps.append(iteration_stats)


class Broken:
    def record(self, iteration_stats: IterationStats) -> None:
        raise RuntimeError("a broken stat logger")


def test_every_step_goes_to_the_stat_loggers_and_a_broken_one_kills_nothing(embedded, caplog):
    engine = make_engine(embedded, num_blocks=64)
    recorder = Recorder()
    engine.add_stat_logger(Broken())
    engine.add_stat_logger(recorder)
    params = greedy(max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    steps_run: list = []
    with caplog.at_level(logging.ERROR, logger="llm-course"):
        done = run_all(engine, {"a": [1, 2, 3, 4], "b": [5, 6, 7]}, params,
                       on_step=steps_run.append)
    assert sorted(done) == ["a", "b"] and all(o.num_output_tokens == 5 for o in done.values())
    assert "a broken stat logger" in caplog.text  # logged, and the engine went on
    assert len(recorder.steps) == len(steps_run)  # one IterationStats per step
    steps = recorder.steps
    assert sum(len(s.time_to_first_tokens_iter) for s in steps) == 2
    assert sum(len(s.inter_token_latencies_iter) for s in steps) == 2 * 4
    assert sum(s.num_generation_tokens for s in steps) == 10 == engine.stats.generation_tokens
    assert sum(s.num_prompt_tokens for s in steps) == 7 == engine.stats.prompt_tokens
    finished = {f.request_id: f for s in steps for f in s.finished_requests}
    assert sorted(finished) == ["a", "b"]
    for f in finished.values():
        assert f.num_generation_tokens == 5 and f.max_tokens_param == 5
        assert 0 <= f.queued_time <= f.e2e_latency and f.prefill_time > 0
        assert f.inference_time == pytest.approx(f.prefill_time + f.decode_time)


def test_the_time_to_first_token_runs_from_the_arrival_at_the_async_front(embedded):
    from common.engine.async_llm import AsyncLLM
    engine = AsyncLLM(make_engine(embedded, num_blocks=64))
    recorder = Recorder()
    engine.add_stat_logger(recorder)

    async def one_request() -> list:
        arrived = time.monotonic() - 10.0  # as if it had come in 10 s ago
        stream = engine.add_request("r", [1, 2, 3], greedy(max_tokens=2, ignore_eos=True),
                                    arrival_time=arrived)
        return [output async for output in stream]

    outputs = asyncio.run(one_request())
    assert outputs[-1].finished
    (ttft,) = [t for s in recorder.steps for t in s.time_to_first_tokens_iter]
    (finished,) = [f for s in recorder.steps for f in s.finished_requests]
    assert ttft >= 10.0 and finished.queued_time >= 10.0 and finished.e2e_latency >= ttft
