"""Prometheus metrics with vLLM's names (ch06), served at `GET /metrics`.

Two kinds of figures:

- what the engine already counts (queues, KV usage, tokens, preemptions,
  prefix-cache hits, finished requests) is read from `engine.snapshot()`
  at scrape time by a custom collector: the figures the engine loop
  published after its last step, the same as `/stats` shows, read without
  waiting for a step;
- latencies are observed by the server as each request's outputs arrive:
  time to first token, inter-token latency, end-to-end latency, and the
  time spent waiting in the queue before the first step.

Every metric carries a `model_name` label, as vLLM's do. Point Prometheus
(or Grafana, or `curl`) at `/metrics`.

Left out: vLLM's per-iteration histograms (tokens per step, prefill and
decode time), the request parameter histograms (n, max_tokens) and the
speculative-decoding and LoRA metrics.
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Buckets close to vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class EngineCollector:
    """Turns one `engine.snapshot()` into gauges and counters at scrape time."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str,
                 alive: Callable[[], bool]):
        self.snapshot = snapshot
        self.model_name = model_name
        self.alive = alive

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])  # adds "_total"
        family.add_metric([self.model_name], value)
        return family

    def collect(self):
        yield self._gauge("llm_course:engine_alive", "1 while the engine loop runs; 0 once "
                          "it has died (the server then exits).", float(self.alive()))
        s = self.snapshot()
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.",
                          s["running"])
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                          s["waiting"])
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                          s["kv_cache_usage_perc"] / 100.0)
        yield self._counter("vllm:prompt_tokens", "Prompt tokens computed (prefill).",
                            s["prompt_tokens"])
        yield self._counter("vllm:generation_tokens", "Tokens generated.",
                            s["generation_tokens"])
        yield self._counter("vllm:num_preemptions", "Sequences preempted (recomputed).",
                            s["num_preemptions"])
        yield self._counter("vllm:prefix_cache_queries", "Full prompt blocks looked "
                            "up in the prefix cache.", s["prefix_cache_queries"])
        yield self._counter("vllm:prefix_cache_hits", "Full prompt blocks found in "
                            "the prefix cache.", s["prefix_cache_hits"])
        success = CounterMetricFamily("vllm:request_success", "Finished requests by "
                                      "finish reason.", labels=["model_name", "finished_reason"])
        for reason, count in sorted(s["finished"].items()):
            success.add_metric([self.model_name, reason], count)
        yield success


class Metrics:
    """One registry per server: the engine's figures and the latency histograms."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str,
                 alive: Callable[[], bool] = lambda: True,
                 collector_cls: type = None, tracker_cls: type = None):
        """`collector_cls`, `tracker_cls`: EngineCollector and RequestTracker
        unless given (the exercise of chapter 06 gives the learner's)."""
        self.registry = CollectorRegistry()
        self.registry.register((collector_cls or EngineCollector)(snapshot, model_name, alive))
        self.tracker_cls = tracker_cls or RequestTracker
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time from request arrival to its first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between two tokens of a request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Time from request arrival to its last token.", REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time a request waited before its first step.",
                                    REQUEST_BUCKETS)

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self) -> "RequestTracker":
        return self.tracker_cls(self)


class RequestTracker:
    """Observes one sequence's latencies as its outputs arrive at the server."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = time.monotonic()
        self.last_token_at: float | None = None

    def on_output(self, output) -> None:
        """`output`: a RequestOutput (engine times are time.monotonic())."""
        now = time.monotonic()
        if self.last_token_at is None:
            self.metrics.ttft.observe(now - self.start)
            if output.first_scheduled_time is not None:
                self.metrics.queue_time.observe(output.first_scheduled_time
                                                - output.arrival_time)
        else:
            self.metrics.itl.observe(now - self.last_token_at)
        self.last_token_at = now
        if output.finished:
            self.metrics.e2e.observe(now - self.start)
