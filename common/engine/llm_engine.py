"""LLMEngine (ch03-06): add_request / step / abort.

`LLMEngine.step()` is one iteration, as in nano-vllm:

    batch   = scheduler.schedule()                  # who runs, how many tokens each
    sampled = model_runner.execute_model(batch)     # one forward pass, one sampler call
    seqs    = scheduler.update_from_output(batch, sampled)  # append, finish, free
    outputs = output_processor.process(seqs, iteration_stats)  # text, stops, deltas
    for logger in stat_loggers: logger.record(iteration_stats)   # ch06: the step's times
    propose_drafts()                                # ch06: --speculative-config

The engine trusts its requests: the entrypoints (the HTTP servers, the
offline `LLM`) validate each one once with `check_request` before
`add_request`. One request's failure while sampling or processing its
output finishes that request with an error; the others go on.

The components a chapter switches on are arguments: the scheduler's type
(`StaticScheduler` ch03-04, `ContinuousScheduler` ch05), and a type in the
config: `block_size=None` is chapter 03's one block of `max_model_len`
slots per sequence (a contiguous region), an int chapter 04's small blocks.

The model's side (device, weights, card, KV cache, `ModelRunner`) is this
rank's `Worker` (common/engine/worker.py), built by the same
`build_worker` as every other rank. ch06, `--tensor-parallel-size N`: this
process is rank 0 (scheduler, sampler and output processing run here,
once); ranks 1..N-1 run in worker processes that it starts
(common/engine/tp_workers.py) and stops in `close()`. The scheduler sees
one cache of `num_blocks` blocks; each rank holds its KV heads' part of
every block.

ch06, latencies: every new token is timed here, once per step, whatever
the request's output kind (`IterationStats`, common/engine/stats.py: time
to first token from the request's `arrival_time`, inter-token latencies,
and when a request finishes its e2e, queue, prefill and decode times).
Each stat logger (`add_stat_logger`, vLLM's name: chapter 06's Prometheus
`Metrics`) gets the step's `IterationStats`; one that raises is logged,
and the engine goes on.

ch06, structured outputs: a request with `SamplingParams.structured_outputs`
gets a grammar matcher (common/engine/structured_output.py, xgrammar)
when it is added; `compile_grammar` is what the servers call first, off
the event loop, so that a bad schema is their 400. ch06, speculative
decoding (`--speculative-config`): after each step, every decoding
sequence gets its n-gram drafts for the next one
(common/engine/ngram_proposer.py), and the step's drafts checked and
accepted are counted (vLLM's `vllm:spec_decode_*`).

Left out: an engine core in its own process (vLLM's v1 runs it apart from
the API server, over ZeroMQ), LoRA, multimodal inputs.
The async front that servers use is common/engine/async_llm.py.
"""
from __future__ import annotations

import logging
import threading
import time
from functools import partial

import torch

from common.autoregressive import eos_token_ids
from common.config import ConfigError, EngineConfig
from common.engine.block_manager import BlockManager, KVCacheUsage
from common.engine.kv_cache import KVCache
from common.engine.ngram_proposer import NgramProposer
from common.engine.output_processor import OutputProcessor
from common.engine.scheduler import (
    ContinuousScheduler,
    ScheduledSeq,
    Scheduler,
    StaticScheduler,
)
from common.engine.sequence import Sequence
from common.engine.stats import EngineStats, IterationStats
from common.engine.structured_output import StructuredOutputManager
from common.engine.tp_workers import TPWorkers, start_ranks
from common.engine.worker import build_worker
from common.layers.sampler import RequestSamplingState
from common.loader import LoadedModel, load_model
from common.models import check_tensor_parallel
from common.outputs import FinishReason, RequestOutput
from common.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("llm-course")
LOG_INTERVAL_S = 5.0
DEFAULT_MAX_TOKENS = 256  # when a request gives none (chapter 06 fills the context)


class ContextLengthError(ValueError):
    """The prompt plus the completion do not fit in `max_model_len`."""


def check_context_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The context rule, for every chapter (01-02 have no engine)."""
    total = num_prompt_tokens + max_tokens
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your prompt has {num_prompt_tokens} tokens, which leaves no room for a "
            "completion. Please reduce the length of the prompt.")
    if total > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {total} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the length of the prompt "
            "or of the completion.")


def default_max_tokens(num_prompt_tokens: int, room: int,
                       cap: int | None = DEFAULT_MAX_TOKENS) -> int:
    """max_tokens for a request that gives none, when `room` tokens fit in
    all: what is left, at most `cap` (None: no cap, vLLM's rule, chapter
    06). At least 1, so that a prompt too long fails the context check."""
    left = room - num_prompt_tokens
    return max(1, left if cap is None else min(cap, left))


class LLMEngine:
    def __init__(self, config: EngineConfig,
                 scheduler_cls: type[Scheduler] = ContinuousScheduler,  # ch05: the default
                 loaded: LoadedModel | None = None, num_blocks: int | None = None,
                 log_interval_s: float = LOG_INTERVAL_S,
                 block_manager_cls: type[BlockManager] = BlockManager, attention_ops=None,
                 quant_ops=None):
        """`num_blocks`: a fixed cache size (tests) instead of sizing from the card.
        `block_manager_cls`, `attention_ops`: the components, replaceable (the
        exercises put the learner's in). `quant_ops`: how `--quantization`
        multiplies (default: `worker.quant_ops_for` the device). With
        `--quantization`, the model (`loaded`, if given) is quantized in place."""
        self.config = config
        if config.speculative_config is not None and issubclass(scheduler_cls, StaticScheduler):
            raise ConfigError("--speculative-config needs continuous batching (chapter 05 on): "
                              "a static batch reserves no room for draft tokens.")
        self.loaded = loaded or load_model(config.model, config.dtype, config.device,
                                           config.load_format, config.seed)
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = min(len(self.tokenizer), self.loaded.model.config.vocab_size)
        self.max_model_len = config.context_length(self.loaded.max_model_len)
        # ch03: one block of max_model_len slots per sequence = a contiguous region.
        self.block_size = config.block_size or self.max_model_len
        check_tensor_parallel(self.loaded.model.config, config.tensor_parallel_size,
                              config.quantization)  # ch06
        self.workers: TPWorkers | None = None
        if config.tensor_parallel_size > 1:  # ch06: ranks 1..N-1, a process each
            self.workers = start_ranks(config, self.block_size, num_blocks)
        build = partial(build_worker, config, 0, self.block_size, num_blocks, loaded=self.loaded,
                        attention_ops=attention_ops, quant_ops=quant_ops)
        self.worker = self.workers.build_rank0(build) if self.workers else build()  # rank 0
        self.block_manager = block_manager_cls(self.worker.kv_cache.num_blocks, self.block_size,
                                               config.enable_prefix_caching)  # ch04: blocks
        self.eos_token_ids = eos_token_ids(self.loaded.model, self.tokenizer)
        self.scheduler = scheduler_cls(self.block_manager, config.max_num_seqs,
                                       config.max_num_batched_tokens, self.eos_token_ids,
                                       self.max_model_len,
                                       long_prefill_token_threshold=config.prefill_cap)
        self.output_processor = OutputProcessor(self.tokenizer)
        spec = config.speculative_config  # ch06
        self.proposer = spec and NgramProposer(spec.num_speculative_tokens,
                                               spec.prompt_lookup_max, spec.prompt_lookup_min)
        self._structured_output: StructuredOutputManager | None = None  # ch06: on first use
        self._structured_output_lock = threading.Lock()
        self.sequences: dict[str, Sequence] = {}  # unfinished requests
        self.stats = EngineStats()
        self.stat_loggers: list = []  # ch06: add_stat_logger; each records every step
        self._seed_counter = config.seed
        self.log_interval_s = log_interval_s
        self._last_log = (time.monotonic(), 0, 0)  # time, prompt, generation tokens

    def close(self) -> None:
        """Stop the tensor-parallel workers (ch06); nothing to do on one rank."""
        if self.workers is not None:
            self.workers.shutdown()

    # ------------------------------------------------------------ requests
    @property
    def cache_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.block_manager.num_blocks * self.block_size

    def default_max_tokens(self, num_prompt_tokens: int,
                           cap: int | None = DEFAULT_MAX_TOKENS) -> int:
        """What fits in the context and in the whole cache, at most `cap`."""
        return default_max_tokens(num_prompt_tokens, min(self.max_model_len, self.cache_tokens),
                                  cap)

    @property
    def structured_output(self) -> StructuredOutputManager:
        """ch06: the grammar compiler, built on first use (xgrammar reads the
        whole vocabulary once), from any thread."""
        with self._structured_output_lock:
            if self._structured_output is None:
                spec = self.config.speculative_config
                self._structured_output = StructuredOutputManager(
                    self.tokenizer, self.loaded.model.config.vocab_size,
                    sorted(self.eos_token_ids), spec.num_speculative_tokens if spec else 0)
            return self._structured_output

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """ch06: compile a constraint now (raises `GrammarError`, a
        ValueError); the servers call it in a worker thread, and the
        compiled grammar is cached for `add_request`."""
        self.structured_output.compile(params)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse at once what could never run (instead of hanging). The
        entrypoints call it once per request, before `add_request`."""
        if num_prompt_tokens == 0:
            raise ValueError("The prompt is empty.")
        if params.structured_outputs is not None:  # ch06: a cache hit after compile_grammar
            self.compile_grammar(params.structured_outputs)
        check_context_length(num_prompt_tokens, params.max_tokens, self.max_model_len)
        needed = self.block_manager.blocks_needed(num_prompt_tokens + params.max_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"The request needs up to {needed} KV blocks but the cache only has "
                f"{self.block_manager.num_blocks}: it can never fit on this card.")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None) -> None:
        """Queue a request that `check_request` accepted. `arrival_time`
        (`time.monotonic()`, default now): when it reached the engine's
        async front; its time to first token, e2e and queue times run from it."""
        if request_id in self.sequences:
            raise ValueError(f"duplicate request id {request_id!r}")
        seed = params.seed
        if seed is None:  # unseeded requests still draw reproducibly per engine
            self._seed_counter += 1
            seed = self._seed_counter * 1_000_003
        sampling = RequestSamplingState(  # built once: see common/layers/sampler.py
            params, prompt_token_ids, self.loaded.model.config.vocab_size,
            sorted(self.eos_token_ids), torch.Generator().manual_seed(seed))
        seq = Sequence(request_id, list(prompt_token_ids), params, sampling=sampling,
                       arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        if params.structured_outputs is not None:  # ch06: its own matcher
            seq.structured_output = self.structured_output.grammar_for(params.structured_outputs)
        self.sequences[request_id] = seq
        self.output_processor.add(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, FinishReason.ABORT)
            self.output_processor.abort(request_id)
            self._count_finished(FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        prompt_tokens = self._count_scheduled(batch)
        sampled = self.worker.model_runner.execute_model(batch)
        self._count_drafts(batch, sampled)  # ch06
        updated = self.scheduler.update_from_output(batch, sampled)
        iteration_stats = IterationStats(time.monotonic())  # ch06: every new token's time
        iteration_stats.num_prompt_tokens = prompt_tokens
        outputs, to_finish = self.output_processor.process(updated, iteration_stats)
        for finish in to_finish:  # stop strings, and failures while processing
            self.scheduler.finish(finish.seq, finish.reason, finish.error)
        for output in outputs:
            if output.finished:
                del self.sequences[output.request_id]
                self._count_finished(output.outputs[0].finish_reason)
        generated = iteration_stats.num_generation_tokens  # counted as the tokens were timed
        self.stats.generation_tokens += generated
        self.stats.iteration_tokens.observe(prompt_tokens + generated)
        self._update_stats()
        self._record(iteration_stats)
        self._maybe_log(idle=not self.has_unfinished_requests())
        if self.proposer is not None:
            self._propose_drafts()
        return outputs

    # ------------------------------------------ ch06: speculative decoding
    def _propose_drafts(self) -> None:
        """Drafts for every sequence that decodes next step: as many as the
        batch size's schedule allows, never more than its answer has room
        for (the step may also add a bonus token)."""
        running = self.scheduler.running
        k = self.config.speculative_config.num_speculative_tokens_for(len(running))
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1 or k == 0:
                seq.spec_token_ids = []  # still prefilling, or no drafts at this batch size
                continue
            room = min(seq.params.max_tokens - seq.num_output_tokens,
                       self.max_model_len - seq.num_tokens) - 1
            seq.spec_token_ids = self.proposer.propose(seq.token_ids, room, k)

    def _count_drafts(self, batch: list[ScheduledSeq], sampled: dict) -> None:
        """vLLM's spec-decode counters: drafts checked, and accepted (the
        tokens a sequence got, but the last)."""
        for item in batch:
            tokens = sampled.get(item.seq)
            if item.draft_token_ids and isinstance(tokens, list):
                self.stats.observe_draft(len(item.draft_token_ids), len(tokens) - 1)

    def _count_scheduled(self, batch: list[ScheduledSeq]) -> int:
        """Count the step's admissions and prompt tokens; returns the latter."""
        now, prompt_tokens = time.monotonic(), 0
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            if seq.first_scheduled_time is None:  # admitted for the first time
                seq.first_scheduled_time = now
                if self.config.enable_prefix_caching:  # vLLM: new requests, in tokens
                    self.stats.prefix_cache_queries += seq.num_tokens
                    self.stats.prefix_cache_hits += seq.num_cached_tokens
            # prompt tokens among those fed now (a recompute counts again)
            prompt_tokens += max(0, min(start + item.num_new_tokens, seq.num_prompt_tokens)
                                 - start)
        self.stats.prompt_tokens += prompt_tokens
        return prompt_tokens

    # ------------------------------------------------------------ figures
    def add_stat_logger(self, logger) -> None:
        """ch06: `logger.record(iteration_stats)` after every step (vLLM's
        stat loggers; chapter 06's Prometheus `Metrics` is one). The list is
        replaced, never changed in place: another thread may add a logger
        while the engine loop goes through the list."""
        self.stat_loggers = [*self.stat_loggers, logger]

    def _record(self, iteration_stats: IterationStats) -> None:
        for logger in self.stat_loggers:
            try:
                logger.record(iteration_stats)
            except Exception:  # noqa: BLE001 - a figure lost, never the engine
                log.exception("stat logger %r failed; the engine goes on", logger)

    def _count_finished(self, reason: FinishReason) -> None:
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def kv_usage(self) -> KVCacheUsage:
        return self.block_manager.usage(self.scheduler.running)

    def _update_stats(self) -> None:
        usage = self.kv_usage()
        s = self.stats
        s.peak_running = max(s.peak_running, len(self.scheduler.running))
        s.peak_reserved_slots = max(s.peak_reserved_slots, usage.reserved_slots)
        s.peak_used_slots = max(s.peak_used_slots, usage.used_slots)
        s.sum_reserved_slots += usage.reserved_slots
        s.sum_used_slots += usage.used_slots

    def avg_kv_waste_perc(self) -> float:
        """KV waste averaged over the steps run so far."""
        s = self.stats
        return 100.0 * (1 - s.sum_used_slots / s.sum_reserved_slots) if s.sum_reserved_slots else 0.0

    def cache_config_info(self) -> dict:
        """The KV cache's settings, under vLLM's CacheConfig names."""
        return {"block_size": self.block_size, "num_gpu_blocks": self.block_manager.num_blocks,
                "enable_prefix_caching": self.config.enable_prefix_caching,
                "cache_dtype": str(self.loaded.dtype).removeprefix("torch."),
                "gpu_memory_utilization": self.config.gpu_memory_utilization}

    def snapshot(self) -> dict:
        """Everything a learner may want to see, as one JSON-able dict."""
        usage = self.kv_usage()
        s, bm = self.stats, self.block_manager
        bytes_per_slot = KVCache.bytes_per_block(self.loaded.model.config, 1, self.loaded.dtype)
        return {
            "block_size": self.block_size, "num_blocks": bm.num_blocks,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": usage.usage_perc,
            "kv_reserved_slots": usage.reserved_slots, "kv_used_slots": usage.used_slots,
            "kv_waste_perc": usage.waste_perc,
            "peak_running": s.peak_running,
            "peak_kv_reserved_bytes": s.peak_reserved_slots * bytes_per_slot,
            "peak_kv_used_bytes": s.peak_used_slots * bytes_per_slot,
            "avg_kv_waste_perc": self.avg_kv_waste_perc(),
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": s.prompt_tokens, "generation_tokens": s.generation_tokens,
            "prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_queried_blocks": bm.prefix_queries,
            "prefix_cache_hit_blocks": bm.prefix_hits,
            "prefix_cache_hit_rate": bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            "iteration_tokens": s.iteration_tokens.as_dict(),
            **(self._spec_decode_snapshot() if self.proposer is not None else {}),  # ch06
            "finished": dict(s.finished),
            "card": self.worker.card.describe(),
        }

    def _spec_decode_snapshot(self) -> dict:
        """ch06: speculative decoding's counts (only with --speculative-config)."""
        s = self.stats
        return {"spec_decode_num_drafts": s.spec_decode_num_drafts,
                "spec_decode_num_draft_tokens": s.spec_decode_num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.spec_decode_num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(
                    s.spec_decode_num_accepted_tokens_per_pos),
                "spec_decode_acceptance_rate": s.spec_decode_acceptance_rate}

    def _maybe_log(self, idle: bool) -> None:
        """vLLM's periodic line: throughput, queues, KV usage, preemptions.
        Written every `log_interval_s` of work, and when the engine goes
        idle, so every burst of requests ends with one."""
        now = time.monotonic()
        last_time, last_prompt, last_gen = self._last_log
        elapsed = now - last_time
        if elapsed < self.log_interval_s and not idle:
            return
        usage = self.kv_usage()
        log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                 "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                 "KV waste: %.1f%% (avg %.1f%%), Preemptions: %d",
                 (self.stats.prompt_tokens - last_prompt) / elapsed,
                 (self.stats.generation_tokens - last_gen) / elapsed,
                 len(self.scheduler.running), len(self.scheduler.waiting),
                 usage.usage_perc, usage.waste_perc, self.avg_kv_waste_perc(),
                 self.scheduler.num_preemptions)
        self._last_log = (now, self.stats.prompt_tokens, self.stats.generation_tokens)
