"""Exercise 06: Prometheus metrics with vLLM's names, served at `GET /metrics`.

You write the two pieces that turn the engine into figures a Prometheus
server (or Grafana, or `curl`) can read:

- `EngineCollector`, a prometheus_client *custom collector*: at each
  scrape, `collect()` calls `snapshot()` once (the engine's own counts,
  the same dict as `/stats`) and yields gauges and counters built from
  it. Nothing is stored between scrapes, so the figures can never drift
  from the engine's, and the engine loop does no extra work.
- `RequestTracker`, one per sequence: the server calls `on_output(output)`
  for each output of that sequence as it arrives, and the tracker
  observes time to first token, inter-token latency, end-to-end latency
  and queue time into the histograms of the `Metrics` object it is given.

`Metrics` (the registry and the four histograms) stays the reference's,
in common/entrypoints/metrics.py: read it first, for the histograms'
names and how `Metrics(..., collector_cls=..., tracker_cls=...)` builds
your two classes.

Graded by `make exercise CH=06` (the tests marked `ex06` in
tests/test_ch06_server.py: the collector on a fixed snapshot, the tracker
on three fake outputs, then /metrics of a served engine). The reference
is common/entrypoints/metrics.py: peek only when stuck. exercises/README.md
has the tasks in order and hints.

Given: `RequestTracker.__init__` (add to it what you need). Left out, as
in the reference: vLLM's per-iteration histograms (tokens per
step, prefill and decode time), the request parameter histograms and the
speculative-decoding and LoRA metrics.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# What collect() yields, each with the label model_name (vLLM's names):
#
#   name                            kind     from snapshot()
#   llm_course:engine_alive         gauge    alive() as 1.0 / 0.0 (not from the snapshot)
#   vllm:num_requests_running       gauge    "running"
#   vllm:num_requests_waiting       gauge    "waiting"
#   vllm:kv_cache_usage_perc        gauge    "kv_cache_usage_perc", a fraction 0-1 (the
#                                            snapshot has a percentage 0-100)
#   vllm:prompt_tokens              counter  "prompt_tokens"
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
        # Hints:
        # - family = GaugeMetricFamily(name, documentation, labels=["model_name"])
        #   family.add_metric([self.model_name], value); yield family
        #   (CounterMetricFamily works the same way).
        # - read alive() first: a scrape must still say 0 when the engine has died.
        # - call self.snapshot() once per collect(): all figures from one moment.
        raise NotImplementedError("collect: yield the gauges and counters of one snapshot()")


class RequestTracker:
    """Observes one sequence's latencies as its outputs arrive at the server."""

    def __init__(self, metrics):
        """`metrics`: the `Metrics` object (common/entrypoints/metrics.py),
        with the histograms `ttft`, `itl`, `e2e` and `queue_time` (each
        already labelled with the model name: call `.observe(seconds)`).
        The server makes the tracker when the request arrives."""
        self.metrics = metrics
        self.start = time.monotonic()  # when the request reached the server

    def on_output(self, output) -> None:
        """One output of the sequence (a RequestOutput; its times are
        `time.monotonic()`): `output.finished`, `output.arrival_time`,
        `output.first_scheduled_time` (None until the engine first ran it).

        Observe, using time.monotonic() now:
        - the first output: time to first token (now - start) and the
          queue time (first_scheduled_time - arrival_time, when known);
        - every later output: the inter-token latency (the gap since the
          previous output);
        - the last output (`output.finished`): the end-to-end latency.
        """
        # Hint: you need one more piece of state, set in __init__.
        raise NotImplementedError("on_output: observe TTFT and queue time, then inter-token "
                                  "gaps, then e2e latency")
