"""Prometheus metrics with vLLM's names and units (ch06), served at `GET /metrics`.

Three kinds of figures:

- what the engine already counts (queues, KV usage, tokens, preemptions,
  prefix-cache hits, finished requests, tokens per step) is read from
  `engine.snapshot()` at scrape time by a custom collector
  (`EngineCollector`): the figures the engine loop published after its
  last step, the same as `/stats` shows, read without waiting for a step;
- latencies and per-request figures are measured by the engine itself,
  once per step, for every token of every request (streamed or not):
  `Metrics` is one of the engine's stat loggers (vLLM's
  `PrometheusStatLogger`; the server registers it with
  `engine.add_stat_logger(metrics)`), and `Metrics.record` observes each
  step's `IterationStats` (common/metrics/stats.py): time to first token,
  inter-token latency, and for each request that finished its end-to-end
  latency and queue time (these four in `LatencyStatLogger`, chapter 06's
  exercise), its prompt and generated tokens, its `max_tokens`, its
  prefill, decode and inference times and its time per output token;
- when all n choices of a prompt have finished, `n` and the most tokens
  one of them generated: the engine knows no parent request (the server
  sends n engine requests), so the server calls `record_parent`.

Every metric carries a `model_name` label, as vLLM's do, and the units are
vLLM's: seconds, tokens (the prefix cache counts tokens, not blocks), KV
usage as a fraction. vLLM's own Grafana dashboard
(examples/observability/prometheus_grafana/grafana.json in vLLM's
repository) reads only these names: all 12 of its panels have data
against chapter 06 (06-openai-server/README.md).

ch07, speculative decoding: vLLM's counters `vllm:spec_decode_num_drafts`,
`_num_draft_tokens`, `_num_accepted_tokens` and `_num_accepted_tokens_per_pos`
(label `position`), and the acceptance rate as a gauge under vLLM v0's
name, `vllm:spec_decode_draft_acceptance_rate` (v1 leaves the division to
the dashboard); as in vLLM, they exist only with `--speculative-config`.

The prompt tokens, as vLLM counts them: `vllm:prompt_tokens` every token
received (cached or not), `vllm:prompt_tokens_by_source` the same split
by source (computed here, or found in the prefix cache), and
`vllm:prompt_tokens_cached` the cache's share.

Left out: the LoRA, KV-connector and multimodal metrics, the prefill-KV
histograms, and per-engine labels (one engine here, or -dp's engines summed).
"""
from __future__ import annotations

import itertools
from typing import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.metrics.stats import IterationStats

# Buckets close to vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)  # vLLM's: preemptions of one request


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50 ... up to max_model_len."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


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

    def _by_label(self, family_cls: type, name: str, doc: str, label: str,
                  counts: dict) -> GaugeMetricFamily | CounterMetricFamily:
        """One metric, a sample per key of `counts` (the key in `label`)."""
        family = family_cls(name, doc, labels=["model_name", label])
        for key, count in sorted(counts.items()):
            family.add_metric([self.model_name, key], count)
        return family

    def collect(self):
        yield self._gauge("llm_course:engine_alive", "1 while the engine loop runs; 0 once "
                          "it has died (the server then exits).", float(self.alive()))
        s = self.snapshot()
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.",
                          s["running"])
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                          s["waiting"])
        yield self._by_label(GaugeMetricFamily, "vllm:num_requests_waiting_by_reason",
                             "Waiting requests by reason: capacity (for room in the batch) "
                             "or deferred (by a passing constraint; none here). They add up "
                             "to vllm:num_requests_waiting.", "reason", s["waiting_by_reason"])
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                          s["kv_cache_usage_perc"] / 100.0)
        yield self._counter("vllm:prompt_tokens", "Prompt tokens received, cached or not "
                            "(counted at each request's first token).", s["prompt_tokens"])
        by_source = s["prompt_tokens_by_source"]
        yield self._by_label(CounterMetricFamily, "vllm:prompt_tokens_by_source",
                             "Prompt tokens by source: local_compute (prefilled here), "
                             "local_cache_hit (found in the prefix cache), "
                             "external_kv_transfer (none here).", "source", by_source)
        yield self._counter("vllm:prompt_tokens_cached", "Prompt tokens found in a cache, "
                            "instead of computed.", by_source["local_cache_hit"])
        yield self._counter("vllm:generation_tokens", "Tokens generated.",
                            s["generation_tokens"])
        yield self._counter("vllm:num_preemptions", "Sequences preempted (recomputed).",
                            s["num_preemptions"])
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in "
                            "tokens: the tokens of each new request.", s["prefix_cache_queries"])
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens "
                            "found in the cache.", s["prefix_cache_hits"])
        yield self._by_label(CounterMetricFamily, "vllm:request_success", "Finished requests "
                             "by finish reason.", "finished_reason", s["finished"])
        if "iteration_tokens" in s:  # the exercise's snapshot may have none
            yield self._step_tokens(s["iteration_tokens"])
        if "spec_decode_num_drafts" in s:
            yield from self._spec_decode(s)

    def _spec_decode(self, s: dict):
        """ch07: speculative decoding's counts (vLLM's names)."""
        yield self._counter("vllm:spec_decode_num_drafts", "Sequences that checked drafts, "
                            "summed over steps.", s["spec_decode_num_drafts"])
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Draft tokens checked.",
                            s["spec_decode_num_draft_tokens"])
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            s["spec_decode_num_accepted_tokens"])
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for position, count in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos
        yield self._gauge("vllm:spec_decode_draft_acceptance_rate", "Draft tokens accepted "
                          "/ checked, since the start (0 before any).",
                          s["spec_decode_acceptance_rate"])

    def _step_tokens(self, counts: dict) -> HistogramMetricFamily:
        """The engine's per-step token counts as vLLM's histogram."""
        family = HistogramMetricFamily("vllm:iteration_tokens_total",
                                       "Tokens per engine step (prompt computed + sampled).",
                                       labels=["model_name"])
        bounds = [str(float(bound)) for bound in counts["bounds"]] + ["+Inf"]
        buckets = list(zip(bounds, itertools.accumulate(counts["counts"])))  # cumulative
        family.add_metric([self.model_name], buckets, counts["sum"])
        return family


class Metrics:
    """One registry per server: the engine's figures (a collector read at
    scrape time) and the request histograms, observed as a stat logger of
    the engine (`record`, after every step) and by the server
    (`record_parent`)."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str,
                 alive: Callable[[], bool] = lambda: True,
                 collector_cls: type = None, latency_logger_cls: type = None,
                 max_model_len: int = 8192, cache_config: dict | None = None):
        """`collector_cls`, `latency_logger_cls`: EngineCollector and
        LatencyStatLogger unless given (the exercise of chapter 06 gives the
        learner's). `cache_config`: vllm:cache_config_info's labels."""
        self.registry = CollectorRegistry()
        self.registry.register((collector_cls or EngineCollector)(snapshot, model_name, alive))
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        # The four latencies (LatencyStatLogger).
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time from request arrival to its first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between two tokens of a request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Time from request arrival to its last token.", REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time a request waited before its first step.",
                                    REQUEST_BUCKETS)
        # When a request finishes (FinishedRequestStats).
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "Time from a "
                                      "request's first step to its first token.",
                                      REQUEST_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "Time from a "
                                     "request's first token to its last.", REQUEST_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "Time from a "
                                        "request's first step to its last token.",
                                        REQUEST_BUCKETS)
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "A request's decode time per token after the first.", ITL_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens",
                                       "Prompt tokens of a finished request.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens",
                                           "Tokens generated by a finished request.", tokens)
        self.max_tokens = histogram("vllm:request_params_max_tokens",
                                    "The max_tokens parameter of a finished request.", tokens)
        self.num_preemptions = histogram("vllm:request_num_preemptions", "Times a finished "
                                         "request was preempted.", PREEMPTION_BUCKETS)
        # When the n choices of a prompt have all finished (record_parent).
        self.params_n = histogram("vllm:request_params_n",
                                  "The n parameter of a finished request.", N_BUCKETS)
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "The most tokens one of a request's n choices generated.", tokens)
        if cache_config is not None:
            info = Gauge("vllm:cache_config_info", "The KV cache's configuration.",
                         sorted(cache_config), registry=self.registry)
            info.labels(**{k: str(v) for k, v in cache_config.items()}).set(1)
        self.latency_logger = (latency_logger_cls or LatencyStatLogger)(self)

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def record(self, iteration_stats: IterationStats) -> None:
        """A stat logger of the engine (`engine.add_stat_logger(metrics)`):
        one step's `IterationStats`, on the engine loop's thread."""
        self.latency_logger.record(iteration_stats)
        for finished in iteration_stats.finished_requests:
            self.prompt_tokens.observe(finished.num_prompt_tokens)
            self.generation_tokens.observe(finished.num_generation_tokens)
            self.max_tokens.observe(finished.max_tokens_param)
            self.num_preemptions.observe(finished.num_preemptions)
            self.prefill_time.observe(finished.prefill_time)
            self.decode_time.observe(finished.decode_time)
            self.inference_time.observe(finished.inference_time)
            if finished.num_generation_tokens > 1:  # vLLM observes a 0 for one token
                self.time_per_output_token.observe(finished.mean_time_per_output_token)

    def record_parent(self, n: int, num_generation_tokens: list[int]) -> None:
        """The server, once all n choices of a prompt have finished (n = 1
        too): `n`, and the most tokens one choice generated (vLLM's
        `ParentRequest`; each choice is an engine request of its own)."""
        self.params_n.observe(n)
        self.max_num_generation_tokens.observe(max(num_generation_tokens))


class LatencyStatLogger:
    """vLLM's `PrometheusStatLogger.record`, its latency half: one engine
    step's `IterationStats` into the four latency histograms."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def record(self, iteration_stats: IterationStats) -> None:
        m = self.metrics
        for ttft in iteration_stats.time_to_first_tokens_iter:
            m.ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            m.itl.observe(itl)
        for finished in iteration_stats.finished_requests:
            m.e2e.observe(finished.e2e_latency)
            m.queue_time.observe(finished.queued_time)
