"""The engine's figures (ch05-07): running totals, what each step did, and
the collector that keeps them (`StatsCollector`).

Two kinds, as in vLLM v1 (vllm/v1/metrics/stats.py, whose names these are):

- running totals for `LLMEngine.snapshot()` (`EngineStats`; tokens per
  step as plain bucket counts, `BucketCounts`): what `/stats` shows and
  `/metrics` reads at scrape time;
- per step, `IterationStats`: the step's prompt and generated tokens (a
  prompt counts whole, as vLLM counts it, when its request gets its first
  token; `PromptTokenStats` splits it by source: computed here or found
  in the prefix cache), the
  time to first token of each request that got its first token, the
  inter-token latency of each that got another, and a
  `FinishedRequestStats` for each request that finished. The output
  processor fills it, sequence by sequence, from each request's
  `RequestStateStats` (its times so far); `LLMEngine.step()` then hands
  it to every stat logger (`LLMEngine.add_stat_logger`: chapter 06's
  Prometheus `Metrics`).

Every new token is timed in the engine, once per step: all the tokens of
a step share that step's `iteration_timestamp`, whatever the request's
`RequestOutputKind` (a FINAL_ONLY request receives one output, yet each
of its tokens is timed). Times are `time.monotonic()` seconds; a
request's `arrival_time` is when it reached the engine's async front
(`AsyncLLM.add_request`) or, offline, `LLMEngine.add_request`.

Left out: vLLM's `SchedulerStats` (the snapshot plays its part), its
frontend wall-clock arrival time beside the engine core's monotonic
times (one clock here; the queue time runs from arrival, not from a
separate QUEUED event), per-step prefix-cache stats (counted in
`EngineStats`), KV transfers (the source `external_kv_transfer` is always
0), LoRA, NaN-corruption and KV-eviction figures; the
speculative-decoding counts (ch07) are running totals in `EngineStats`,
not per step. A request aborted (client gone) or failed before its first token
gives no `FinishedRequestStats`: it has no latencies to observe (its
finish is still counted in `EngineStats.finished`).
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

from common.metrics.observers import StepObserver
from common.outputs import FinishReason

log = logging.getLogger("llm-course")

# vLLM's buckets for the tokens of one engine step (vllm:iteration_tokens_total).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class BucketCounts:
    """A histogram kept as plain counts (the engine knows no Prometheus):
    `counts[i]` observations <= `bounds[i]` and above the bound before it;
    the last count is above every bound."""
    bounds: tuple[int, ...]
    counts: list[int] = field(default_factory=list)
    total: int = 0  # the sum of the observed values

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: int) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def as_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}


@dataclass
class EngineStats:
    """The engine's running totals since it started (`snapshot()`)."""
    num_steps: int = 0  # steps that ran a batch (the live view's frame numbers)
    # vLLM's: every prompt token received (at its request's first token), and
    # of them those computed here and those found in the prefix cache
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    # vLLM's prefix-cache figures, in tokens: a new request's tokens looked
    # up, and those found (the block manager counts blocks, chapter 04)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    iteration_tokens: BucketCounts = field(  # tokens per step (prompt computed + sampled, ours)
        default_factory=lambda: BucketCounts(ITERATION_TOKENS_BUCKETS))
    peak_running: int = 0
    peak_reserved_slots: int = 0
    peak_used_slots: int = 0
    sum_reserved_slots: int = 0  # over steps, for the time-averaged waste
    sum_used_slots: int = 0
    finished: dict = field(default_factory=dict)  # finish reason -> count
    # ch07, speculative decoding (vLLM's SpecDecodingStats): sequences that
    # checked drafts, drafts checked, drafts accepted, and accepted per position
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """ch07: one sequence checked `num_draft_tokens` drafts this step and
        kept the first `num_accepted_tokens` of them."""
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_draft_tokens
        self.spec_decode_num_accepted_tokens += num_accepted_tokens
        per_pos = self.spec_decode_num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for pos in range(num_accepted_tokens):
            per_pos[pos] += 1

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted drafts / drafts checked (0 before any)."""
        if not self.spec_decode_num_draft_tokens:
            return 0.0
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens

    def spec_decode_snapshot(self) -> dict:
        """ch07: speculative decoding's counts (only with --speculative-config)."""
        return {"spec_decode_num_drafts": self.spec_decode_num_drafts,
                "spec_decode_num_draft_tokens": self.spec_decode_num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.spec_decode_num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(
                    self.spec_decode_num_accepted_tokens_per_pos),
                "spec_decode_acceptance_rate": self.spec_decode_acceptance_rate}


@dataclass
class RequestStateStats:
    """One unfinished request's times so far (vLLM's name), kept by the
    output processor across steps. vLLM calls the last three
    `scheduled_ts`, `first_token_ts`, `last_token_ts`."""
    arrival_time: float
    first_scheduled_time: float | None = None  # its first step (a preemption does not reset it)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


@dataclass
class PromptTokenStats:
    """A step's prompt tokens by source (vLLM's), counted when a request
    gets its first token: computed + local_cache_hit = total."""
    computed: int = 0  # prefilled here (vLLM's source "local_compute")
    local_cache_hit: int = 0  # found in the prefix cache (ch04)
    total: int = 0

    def update(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.computed += num_prompt_tokens - num_cached_tokens
        self.local_cache_hit += num_cached_tokens
        self.total += num_prompt_tokens


@dataclass
class FinishedRequestStats:
    """A finished request's figures (vLLM's names), in seconds and tokens."""
    request_id: str
    finish_reason: FinishReason  # STOP, LENGTH or ERROR
    e2e_latency: float  # arrival -> the step that finished it (its last token's)
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int
    queued_time: float  # arrival -> first step
    prefill_time: float  # first step -> first token
    inference_time: float  # first step -> last token
    decode_time: float  # first token -> last token
    mean_time_per_output_token: float  # decode_time / (tokens - 1); 0 for one token
    num_preemptions: int = 0  # times it was preempted (and recomputed)


class IterationStats:
    """What one engine step did (vLLM's name), for the stat loggers. All
    its times are taken at `iteration_timestamp`, once per step."""

    def __init__(self, iteration_timestamp: float):
        self.iteration_timestamp = iteration_timestamp
        self.prompt_token_stats = PromptTokenStats()  # prompts whose first token came now
        self.num_computed_prompt_tokens = 0  # prompt tokens the step computed (ours)
        self.num_generation_tokens = 0
        self.time_to_first_tokens_iter: list[float] = []  # arrival -> first token
        self.inter_token_latencies_iter: list[float] = []  # previous token -> this one
        self.finished_requests: list[FinishedRequestStats] = []

    def __repr__(self) -> str:
        return f"IterationStats({vars(self)})"

    @property
    def num_prompt_tokens(self) -> int:
        """vLLM's: the whole prompts of the requests whose first token came now."""
        return self.prompt_token_stats.total

    def update_from_output(self, req_stats: RequestStateStats,
                           first_scheduled_time: float, num_new_tokens: int = 1,
                           num_prompt_tokens: int = 0, num_cached_tokens: int = 0) -> None:
        """One request got new tokens this step: one, or with speculative
        decoding (ch07) up to k + 1, which arrive together (one latency,
        as vLLM counts them). `first_scheduled_time`: the engine's stamp of
        its first step (`Sequence.first_scheduled_time`), kept at its
        first token, when its prompt's tokens are counted too."""
        now = self.iteration_timestamp
        if req_stats.num_generation_tokens == 0:
            self.prompt_token_stats.update(num_prompt_tokens, num_cached_tokens)
            req_stats.first_scheduled_time = first_scheduled_time
            req_stats.first_token_time = now
            self.time_to_first_tokens_iter.append(now - req_stats.arrival_time)
        else:
            self.inter_token_latencies_iter.append(now - req_stats.last_token_time)
        req_stats.last_token_time = now
        req_stats.num_generation_tokens += num_new_tokens
        self.num_generation_tokens += num_new_tokens

    def update_from_finished_request(self, request_id: str, finish_reason: FinishReason,
                                     num_prompt_tokens: int, max_tokens_param: int,
                                     req_stats: RequestStateStats,
                                     num_preemptions: int = 0) -> None:
        """A request finished this step (after its last `update_from_output`).
        One that never got a token has no latencies: nothing is recorded."""
        if req_stats.num_generation_tokens == 0:
            return
        arrival, scheduled = req_stats.arrival_time, req_stats.first_scheduled_time
        first, last = req_stats.first_token_time, req_stats.last_token_time
        decode_time = last - first
        generated = req_stats.num_generation_tokens
        self.finished_requests.append(FinishedRequestStats(
            request_id=request_id, finish_reason=finish_reason,
            e2e_latency=self.iteration_timestamp - arrival,
            num_prompt_tokens=num_prompt_tokens, num_generation_tokens=generated,
            max_tokens_param=max_tokens_param,
            queued_time=scheduled - arrival,
            prefill_time=first - scheduled, inference_time=last - scheduled,
            decode_time=decode_time,
            mean_time_per_output_token=decode_time / (generated - 1) if generated > 1 else 0.0,
            num_preemptions=num_preemptions))


class StatLoggers:
    """ch06: the stat loggers (vLLM's), each handed every step's
    `IterationStats` (`record`). The list is replaced, never changed in
    place: another thread may add a logger while a step goes through it.
    A logger that fails loses its figure, never the engine."""

    def __init__(self) -> None:
        self._loggers: list = []

    def add(self, logger) -> None:
        self._loggers = [*self._loggers, logger]

    def record(self, iteration_stats: IterationStats) -> None:
        for logger in self._loggers:
            try:
                logger.record(iteration_stats)
            except Exception:  # noqa: BLE001 - a figure lost, never the engine
                log.exception("stat logger %r failed; the engine goes on", logger)


class StatsCollector(StepObserver):
    """The engine's figures, kept apart from its step (ch05-07): fed each
    step's batch and sampled tokens, it keeps the running totals
    (`EngineStats`), hands each step's `IterationStats` to the stat loggers
    (chapter 06's Prometheus `Metrics`), and writes vLLM's periodic log line.

    It reads the scheduler's queues and the block manager's usage; it never
    changes them. Speculation's counts (ch07) come from the batch alone: a
    sequence with k + 1 logits rows checked k drafts, and of the tokens it
    got, all but the last were drafts accepted."""

    def __init__(self, scheduler, block_manager, enable_prefix_caching: bool,
                 log_interval_s: float):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.enable_prefix_caching = enable_prefix_caching
        self.totals = EngineStats()
        self.stat_loggers = StatLoggers()  # ch06: add_stat_logger; each records every step
        self.log_interval_s = log_interval_s
        self._last_log = (time.monotonic(), 0, 0)  # time, prompt, generation tokens
        self._step_prompt_tokens = 0  # observe_scheduled's count, for new_iteration

    # ------------------------------------------------------ fed by step()
    def observe_scheduled(self, batch) -> None:
        """Before the step runs: first admissions (prefix-cache lookups)
        and the prompt tokens computed now (a recompute counts again: the
        step's work, for the tokens-per-step histogram)."""
        now, prompt_tokens = time.monotonic(), 0
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            if seq.first_scheduled_time is None:  # admitted for the first time
                seq.first_scheduled_time = now
                if self.enable_prefix_caching:  # vLLM: new requests, in tokens
                    self.totals.prefix_cache_queries += seq.num_tokens
                    self.totals.prefix_cache_hits += seq.num_cached_tokens
            prompt_tokens += max(0, min(start + item.num_new_tokens, seq.num_prompt_tokens)
                                 - start)
        self._step_prompt_tokens = prompt_tokens

    def observe_sampled(self, batch, sampled: dict) -> None:
        """After the forward pass, before the scheduler takes the tokens in:
        ch07, each sequence that checked drafts (more than one logits row)."""
        for item in batch:
            tokens = sampled.get(item.seq)
            if item.num_logits_rows > 1 and isinstance(tokens, list):
                self.totals.observe_draft(item.num_logits_rows - 1, len(tokens) - 1)

    def new_iteration(self) -> IterationStats:
        """The step's `IterationStats`: every new token is timed now."""
        iteration_stats = IterationStats(time.monotonic())
        iteration_stats.num_computed_prompt_tokens = self._step_prompt_tokens
        return iteration_stats

    def observe_step(self, iteration_stats: IterationStats, outputs: list) -> None:
        """After the step: finished requests, tokens, KV figures; then the
        stat loggers and, when due, the log line."""
        for output in outputs:
            if output.finished:
                self.count_finished(output.outputs[0].finish_reason)
        t = self.totals
        t.num_steps += 1
        t.generation_tokens += iteration_stats.num_generation_tokens
        prompts = iteration_stats.prompt_token_stats
        t.prompt_tokens += prompts.total
        t.prompt_tokens_computed += prompts.computed
        t.prompt_tokens_cached += prompts.local_cache_hit
        t.iteration_tokens.observe(iteration_stats.num_computed_prompt_tokens
                                   + iteration_stats.num_generation_tokens)
        usage = self.kv_usage()
        t.peak_running = max(t.peak_running, len(self.scheduler.running))
        t.peak_reserved_slots = max(t.peak_reserved_slots, usage.reserved_slots)
        t.peak_used_slots = max(t.peak_used_slots, usage.used_slots)
        t.sum_reserved_slots += usage.reserved_slots
        t.sum_used_slots += usage.used_slots
        self.stat_loggers.record(iteration_stats)
        self.maybe_log(idle=not self.scheduler.has_unfinished())

    def count_finished(self, reason) -> None:
        self.totals.finished[reason] = self.totals.finished.get(reason, 0) + 1

    def observe_finished_between_steps(self, reason,
                                       iteration_stats: IterationStats | None = None) -> None:
        """A request finished outside a step (`LLMEngine.abort`): counted,
        and its latencies (ch09's STOP from the API process) recorded."""
        self.count_finished(reason)
        if iteration_stats is not None:
            self.stat_loggers.record(iteration_stats)

    # ------------------------------------------------------------ readers
    def kv_usage(self):
        return self.block_manager.usage(self.scheduler.running)

    def avg_kv_waste_perc(self) -> float:
        """KV waste averaged over the steps run so far."""
        t = self.totals
        return 100.0 * (1 - t.sum_used_slots / t.sum_reserved_slots) if t.sum_reserved_slots else 0.0

    def add_stat_logger(self, logger) -> None:
        """ch06: `logger.record(iteration_stats)` after every step."""
        self.stat_loggers.add(logger)

    def maybe_log(self, idle: bool) -> None:
        """vLLM's periodic line: throughput, queues, KV usage, preemptions.
        Written every `log_interval_s` of work, and when the engine goes
        idle, so every burst of requests ends with one."""
        now = time.monotonic()
        last_time, last_prompt, last_gen = self._last_log
        elapsed = now - last_time
        if elapsed < self.log_interval_s and not idle:
            return
        usage, t = self.kv_usage(), self.totals
        log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                 "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                 "KV waste: %.1f%% (avg %.1f%%), Preemptions: %d",
                 (t.prompt_tokens - last_prompt) / elapsed,
                 (t.generation_tokens - last_gen) / elapsed,
                 len(self.scheduler.running), len(self.scheduler.waiting),
                 usage.usage_perc, usage.waste_perc, self.avg_kv_waste_perc(),
                 self.scheduler.num_preemptions)
        self._last_log = (now, t.prompt_tokens, t.generation_tokens)

    def snapshot(self, bytes_per_slot: int, speculating: bool) -> dict:
        """The figures of `LLMEngine.snapshot()` that this collector keeps."""
        usage, t, bm = self.kv_usage(), self.totals, self.block_manager
        return {
            "num_steps": t.num_steps,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": usage.usage_perc, "kv_used_blocks": usage.used_blocks,
            "kv_reserved_slots": usage.reserved_slots, "kv_used_slots": usage.used_slots,
            "kv_waste_perc": usage.waste_perc,
            "peak_running": t.peak_running,
            "peak_kv_reserved_bytes": t.peak_reserved_slots * bytes_per_slot,
            "peak_kv_used_bytes": t.peak_used_slots * bytes_per_slot,
            "avg_kv_waste_perc": self.avg_kv_waste_perc(),
            "num_preemptions": self.scheduler.num_preemptions,
            "waiting_by_reason": {"capacity": len(self.scheduler.waiting), "deferred": 0},
            "prompt_tokens": t.prompt_tokens, "generation_tokens": t.generation_tokens,
            "prompt_tokens_by_source": {"local_compute": t.prompt_tokens_computed,
                                        "local_cache_hit": t.prompt_tokens_cached,
                                        "external_kv_transfer": 0},
            "prefix_cache_queries": t.prefix_cache_queries, "prefix_cache_hits": t.prefix_cache_hits,
            "prefix_cache_queried_blocks": bm.prefix_queries,
            "prefix_cache_hit_blocks": bm.prefix_hits,
            "prefix_cache_hit_rate": bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            "iteration_tokens": t.iteration_tokens.as_dict(),
            **(t.spec_decode_snapshot() if speculating else {}),  # ch07
            "finished": dict(t.finished),
        }
