"""Exercise 06: Prometheus metrics with vLLM's names, served at `GET /metrics`.

You write the two pieces that turn the engine into figures a Prometheus
server (or Grafana, or `curl`) can read:

- `EngineCollector`, a prometheus_client *custom collector*: at each
  scrape, `collect()` calls `snapshot()` once (the engine's own counts,
  the same dict as `/stats`) and yields gauges and counters built from
  it. Nothing is stored between scrapes, so the figures can never drift
  from the engine's, and the engine loop does no extra work.
- `LatencyStatLogger`, the latency half of vLLM's
  `PrometheusStatLogger.record`: the engine times every token itself,
  once per step, and after each step hands every stat logger that step's
  `IterationStats` (common/metrics/stats.py); `record` observes its time
  to first token, inter-token latencies, and for each request that
  finished its end-to-end latency and queue time, into the histograms
  of the `Metrics` object it is given.

`Metrics` (the registry and the histograms) is given, the course's own,
in common/entrypoints/metrics.py: its histograms are `ttft`, `itl`, `e2e`
and `queue_time`, and `Metrics(..., collector_cls=...,
latency_logger_cls=...)` builds your two classes (`Metrics.record`,
which the engine calls after each step, calls your `record`).

Graded by `make exercise CH=06` (the tests marked `ex06` in
tests/test_ch06_server.py: the collector on a fixed snapshot, the logger
on three steps' IterationStats, then /metrics of a served engine).
exercises/README.md has the tasks in order and the hints; a failing test
names the hint to read first. Once every test passes, compare your
classes with `EngineCollector` and `LatencyStatLogger` in
common/entrypoints/metrics.py, the ones the server runs.

Given: `LatencyStatLogger.__init__`. Left out on purpose, although the
course's classes do them: the tokens-per-step histogram and the
speculative-decoding counters (its collector yields them; drafts come in
chapter 07), the histograms of each request's tokens, parameters and
prefill, decode and inference times (`Metrics.record`,
`Metrics.record_parent`). The exercise keeps the two ideas, reading at
scrape time and observing what the engine timed; the rest is more of
the same. Left out of both: the LoRA metrics.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# What collect() yields, each with the label model_name (vLLM's names):
#
#   name                            kind     from snapshot()
#   llm_course:engine_alive         gauge    alive() as 1.0 / 0.0 (not from the snapshot)
#   vllm:num_requests_running       gauge    "running"
#   vllm:num_requests_waiting       gauge    "waiting"
#   vllm:num_requests_waiting_by_reason
#                                   gauge    "waiting_by_reason", a dict reason -> count:
#                                            one sample per reason, label reason
#   vllm:kv_cache_usage_perc        gauge    "kv_cache_usage_perc", a fraction 0-1 (the
#                                            snapshot has a percentage 0-100)
#   vllm:prompt_tokens              counter  "prompt_tokens" (every token received)
#   vllm:prompt_tokens_by_source    counter  "prompt_tokens_by_source", a dict source ->
#                                            count: one sample per source, label source
#   vllm:prompt_tokens_cached       counter  "prompt_tokens_by_source"["local_cache_hit"]
#   vllm:generation_tokens          counter  "generation_tokens"
#   vllm:num_preemptions            counter  "num_preemptions"
#   vllm:prefix_cache_queries       counter  "prefix_cache_queries"
#   vllm:prefix_cache_hits          counter  "prefix_cache_hits"
#   vllm:request_success            counter  "finished", a dict reason -> count: one
#                                            sample per reason, with a second label
#                                            finished_reason
#
# A CounterMetricFamily named "vllm:prompt_tokens" is exposed as
# "vllm:prompt_tokens_total": prometheus_client adds the suffix.


class EngineCollector:
    """Turns one `engine.snapshot()` into gauges and counters at scrape time."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str,
                 alive: Callable[[], bool]):
        """`snapshot()`: the engine's counts as a dict (call it at each scrape,
        never keep its result); `model_name`: the value of every metric's
        `model_name` label; `alive()`: True while the engine loop runs.
        `Metrics.__init__` builds the collector and registers it."""
        raise NotImplementedError("EngineCollector.__init__: keep the three arguments "
                                  "(self.snapshot = snapshot, ...)")

    def collect(self) -> Iterator[Metric]:
        """Yield every metric of the table above (prometheus_client calls
        this at each scrape of the registry)."""
        # Read alive() first: a scrape must still say 0 when the engine has
        # died. Stuck? exercises/README.md, hints 1 to 3.
        raise NotImplementedError("collect: yield the gauges and counters of one snapshot()")


class LatencyStatLogger:
    """One engine step's IterationStats into the four latency histograms."""

    def __init__(self, metrics):
        """`metrics`: the `Metrics` object (common/entrypoints/metrics.py),
        with the histograms `ttft`, `itl`, `e2e` and `queue_time` (each
        already labelled with the model name: call `.observe(seconds)`).
        `Metrics.__init__` builds the logger."""
        self.metrics = metrics

    def record(self, iteration_stats) -> None:
        """One engine step (an `IterationStats`, common/metrics/stats.py; its
        times are seconds, measured by the engine at the step's one
        timestamp, for every request, streamed or not):

        - `iteration_stats.time_to_first_tokens_iter`: a list, one time to
          first token (arrival -> first token) per request that got its
          first token at this step;
        - `iteration_stats.inter_token_latencies_iter`: a list, one gap
          (previous token -> this one) per request that got a later token;
        - `iteration_stats.finished_requests`: a list of
          `FinishedRequestStats`, one per request that finished at this
          step, with `.e2e_latency` (arrival -> its last token) and
          `.queued_time` (arrival -> its first step).

        Observe each of them into its histogram, and nothing else: the
        engine has done the timing, and keeps no state here across steps.
        """
        raise NotImplementedError("record: observe each TTFT and inter-token latency of the "
                                  "step, and the e2e latency and queue time of each finished "
                                  "request")
