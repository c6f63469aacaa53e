"""LLMEngine (ch03-08): add_request / step / abort.

`LLMEngine.step()` is one iteration, as in nano-vllm:

    batch   = scheduler.schedule()                  # who runs, how many tokens each
    stats_collector.observe_scheduled(batch)        # admissions, prompt tokens
    sampled = model_runner.execute_model(batch)     # one forward pass, one sampling step
    stats_collector.observe_sampled(batch, sampled) # ch07: drafts checked, accepted
    seqs    = scheduler.update_from_output(batch, sampled)  # append, finish, free
    iteration_stats = stats_collector.new_iteration()  # every new token's time
    outputs = output_processor.process(seqs, iteration_stats)  # text, stops, deltas
    stats_collector.observe_step(iteration_stats, outputs)  # totals, loggers, log line
    step_events.observe_step(iteration_stats, outputs)  # when watched: the step's frame

The engine trusts its requests: the entrypoints (the HTTP servers, the
offline `LLM`) validate each one once with `check_request` before
`add_request`. One request's failure while sampling or processing its
output finishes that request with an error; the others go on.

The components a chapter switches on are arguments, never branches in the
step: the scheduler's type (`StaticScheduler` ch03-04,
`ContinuousScheduler` ch05), a type in the config (`block_size=None` is
chapter 03's one block of `max_model_len` slots per sequence, a contiguous
region; an int chapter 04's small blocks), and chapter 07's two:
`structured_output_cls` (the grammar's logits step,
common/engine/structured_output.py, which needs xgrammar) and
`--speculative-config`, which swaps in the `SpeculativeScheduler` and the
model runner's `SpeculativeSampling` (common/engine/spec_decode.py). Both
modules are imported only when they are asked for.

The model's side (device, weights, card, KV cache, `ModelRunner`) is this
rank's `Worker` (common/engine/worker.py), built by the same
`build_worker` as every other rank. ch08, `--tensor-parallel-size N`: this
process is rank 0 (scheduler, sampler and output processing run here,
once); ranks 1..N-1 run in worker processes that it starts
(common/engine/tp_workers.py) and stops in `close()`. The scheduler sees
one cache of `num_blocks` blocks; each rank holds its KV heads' part of
every block.

The figures (running totals, every new token's time, the periodic log
line, the stat loggers such as chapter 06's Prometheus `Metrics`) are the
`StatsCollector`'s (common/engine/stats.py).

Left out: LoRA, multimodal inputs. The async fronts that servers use are
common/engine/async_llm.py (the engine on a thread of the server's
process) and, chapter 09, common/engine/core_client.py (the engine in a
process of its own: common/engine/core.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch

from common.autoregressive import eos_token_ids
from common.config import EngineConfig
from common.engine.block_manager import BlockManager, KVCacheUsage
from common.engine.kv_cache import KVCache
from common.engine.output_processor import OutputProcessor
from common.engine.scheduler import ContinuousScheduler, Scheduler
from common.engine.sequence import Sequence
from common.engine.stats import EngineStats, StatsCollector
from common.engine.step_events import JsonlRecorder, StepEvents
from common.engine.tp_workers import TPWorkers, start_ranks
from common.engine.worker import build_worker
from common.layers.sampler import RequestSamplingState
from common.loader import LoadedModel, load_model
from common.models import check_tensor_parallel
from common.outputs import FinishReason, RequestOutput
from common.sampling_params import SamplingParams, StructuredOutputsParams

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


@dataclass(frozen=True)
class Admission:
    """The engine's admission rules, from its sizes alone: what a front in
    another process (chapter 09) checks without asking the engine."""
    max_model_len: int
    num_blocks: int
    block_size: int

    def check(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse at once what could never run (instead of hanging)."""
        if num_prompt_tokens == 0:
            raise ValueError("The decoder prompt cannot be empty")  # vLLM's words
        check_context_length(num_prompt_tokens, params.max_tokens, self.max_model_len)
        needed = -(-(num_prompt_tokens + params.max_tokens) // self.block_size)  # ceil
        if needed > self.num_blocks:
            raise ValueError(
                f"The request needs up to {needed} KV blocks but the cache only has "
                f"{self.num_blocks}: it can never fit on this card.")

    def default_max_tokens(self, num_prompt_tokens: int,
                           cap: int | None = DEFAULT_MAX_TOKENS) -> int:
        """What fits in the context and in the whole cache, at most `cap`."""
        return default_max_tokens(num_prompt_tokens,
                                  min(self.max_model_len, self.num_blocks * self.block_size), cap)


class LLMEngine:
    def __init__(self, config: EngineConfig,
                 scheduler_cls: type[Scheduler] = ContinuousScheduler,  # ch05: the default
                 loaded: LoadedModel | None = None, num_blocks: int | None = None,
                 log_interval_s: float = LOG_INTERVAL_S,
                 block_manager_cls: type[BlockManager] = BlockManager, attention_ops=None,
                 quant_ops=None, structured_output_cls: type | None = None):
        """`num_blocks`: a fixed cache size (tests) instead of sizing from the card.
        `block_manager_cls`, `attention_ops`: the components, replaceable (the
        exercises put the learner's in). `quant_ops`: how `--quantization`
        multiplies (default: `worker.quant_ops_for` the device). With
        `--quantization`, the model (`loaded`, if given) is quantized in place.
        `structured_output_cls` (ch07): `StructuredOutputManager`, for
        requests that constrain their answer."""
        self.config = config
        sampling_cls = None
        if config.speculative_config is not None:  # ch07: drafts in the step and the sampler
            from common.engine.spec_decode import speculative_components
            scheduler_cls, sampling_cls = speculative_components(scheduler_cls,
                                                                 config.speculative_config)
        shared = loaded is not None  # the caller's model: HF's forward must still run on it
        self.loaded = loaded or load_model(config.model, config.dtype, config.device,
                                           config.load_format, config.seed)
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = min(len(self.tokenizer), self.loaded.model.config.vocab_size)
        self.max_model_len = config.context_length(self.loaded.max_model_len)
        # ch03: one block of max_model_len slots per sequence = a contiguous region.
        self.block_size = config.block_size or self.max_model_len
        check_tensor_parallel(self.loaded.model.config, config.tensor_parallel_size,
                              config.quantization)  # ch08
        self.workers: TPWorkers | None = None
        if config.tensor_parallel_size > 1:  # ch08: ranks 1..N-1, a process each
            self.workers = start_ranks(config, self.block_size, num_blocks)
        build = partial(build_worker, config, 0, self.block_size, num_blocks, loaded=self.loaded,
                        model_shared=shared, attention_ops=attention_ops, quant_ops=quant_ops)
        self.worker = self.workers.build_rank0(build) if self.workers else build()  # rank 0
        self.block_manager = block_manager_cls(self.worker.kv_cache.num_blocks, self.block_size,
                                               config.enable_prefix_caching)  # ch04: blocks
        self.eos_token_ids = eos_token_ids(self.loaded.model, self.tokenizer)
        self.scheduler = scheduler_cls(self.block_manager, config.max_num_seqs,
                                       config.max_num_batched_tokens, self.eos_token_ids,
                                       self.max_model_len,
                                       long_prefill_token_threshold=config.prefill_cap)
        runner = self.worker.model_runner
        if sampling_cls is not None:
            runner.sampling = sampling_cls()  # ch07: the rejection sampler for drafts
        self.structured_output = None  # ch07: the grammar compiler and its logits step
        if structured_output_cls is not None:
            spec = config.speculative_config
            self.structured_output = structured_output_cls(
                self.tokenizer, self.loaded.model.config.vocab_size, sorted(self.eos_token_ids),
                spec.num_speculative_tokens if spec else 0)
            runner.logits_processors.append(self.structured_output)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.sequences: dict[str, Sequence] = {}  # unfinished requests
        self.stats_collector = StatsCollector(self.scheduler, self.block_manager,
                                              config.enable_prefix_caching, log_interval_s)
        self._seed_counter = config.seed
        self.started_at = time.time()
        # Each step as an event (the live view, --record-events, --kv-events-config);
        # None: off, and the step does no extra work.
        self.step_events: StepEvents | None = None
        kv_events = config.kv_events_config
        if kv_events is not None and kv_events.publishes:
            self.enable_step_events().publish_kv_events(kv_events)
        if config.record_events:
            self.enable_step_events().subscribe(
                JsonlRecorder(config.record_events, self.describe()))

    def enable_step_events(self) -> StepEvents:
        """The step's events from now on (built once; call it between steps)."""
        if self.step_events is None:
            self.step_events = StepEvents(self)
        return self.step_events

    def describe(self) -> dict:
        """What a viewer of the step events needs to know once."""
        return {"started_at": self.started_at,  # a restarted server is a new run
                "model": self.config.model_name, "scheduler": type(self.scheduler).__name__,
                "num_blocks": self.block_manager.num_blocks, "block_size": self.block_size,
                "max_model_len": self.max_model_len,
                "max_num_seqs": self.config.max_num_seqs,
                "max_num_batched_tokens": self.config.max_num_batched_tokens,
                "enable_prefix_caching": self.config.enable_prefix_caching,
                "speculative": self.config.speculative_config is not None}

    def close(self) -> None:
        """Stop the tensor-parallel workers (ch08) and the event publishers."""
        if self.workers is not None:
            self.workers.shutdown()
        if self.step_events is not None:
            self.step_events.close()

    # ------------------------------------------------------------ requests
    @property
    def admission(self) -> Admission:
        """The admission rules, from the engine's sizes."""
        return Admission(self.max_model_len, self.block_manager.num_blocks, self.block_size)

    def default_max_tokens(self, num_prompt_tokens: int,
                           cap: int | None = DEFAULT_MAX_TOKENS) -> int:
        """What fits in the context and in the whole cache, at most `cap`."""
        return self.admission.default_max_tokens(num_prompt_tokens, cap)

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """ch07: compile a constraint now (raises `GrammarError`, a
        ValueError); the servers call it in a worker thread, and the
        compiled grammar is cached for `add_request`."""
        if self.structured_output is None:
            raise ValueError("Structured outputs need an engine built with a "
                             "StructuredOutputManager (chapter 07).")
        self.structured_output.compile(params)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse at once what could never run (instead of hanging). The
        entrypoints call it once per request, before `add_request`."""
        if params.structured_outputs is not None and num_prompt_tokens:  # ch07: cached
            self.compile_grammar(params.structured_outputs)  # after the server's compile
        self.admission.check(num_prompt_tokens, params)

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
        if params.structured_outputs is not None:  # ch07: its own matcher
            seq.structured_output = self.structured_output.grammar_for(params.structured_outputs)
        self.sequences[request_id] = seq
        self.output_processor.add(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, FinishReason.ABORT)
            self.output_processor.abort(request_id)
            self.stats_collector.count_finished(FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        self.stats_collector.observe_scheduled(batch)
        if self.step_events is not None:  # the live view: what each request feeds
            self.step_events.observe_scheduled(batch)
        sampled = self.worker.model_runner.execute_model(batch)
        self.stats_collector.observe_sampled(batch, sampled)
        updated = self.scheduler.update_from_output(batch, sampled)
        iteration_stats = self.stats_collector.new_iteration()  # every new token's time
        outputs, to_finish = self.output_processor.process(updated, iteration_stats)
        for finish in to_finish:  # stop strings, and failures while processing
            self.scheduler.finish(finish.seq, finish.reason, finish.error)
        for output in outputs:
            if output.finished:
                del self.sequences[output.request_id]
        self.stats_collector.observe_step(iteration_stats, outputs)
        if self.step_events is not None:  # the live view: the step's frame
            self.step_events.observe_step(iteration_stats, outputs)
        return outputs

    # ------------------------------------------------------------ figures
    @property
    def stats(self) -> EngineStats:
        """The running totals since the engine started."""
        return self.stats_collector.totals

    def add_stat_logger(self, logger) -> None:
        """ch06: `logger.record(iteration_stats)` after every step (vLLM's
        stat loggers; chapter 06's Prometheus `Metrics` is one)."""
        self.stats_collector.add_stat_logger(logger)

    def kv_usage(self) -> KVCacheUsage:
        return self.stats_collector.kv_usage()

    def avg_kv_waste_perc(self) -> float:
        """KV waste averaged over the steps run so far."""
        return self.stats_collector.avg_kv_waste_perc()

    def cache_config_info(self) -> dict:
        """The KV cache's settings, under vLLM's CacheConfig names."""
        return {"block_size": self.block_size, "num_gpu_blocks": self.block_manager.num_blocks,
                "enable_prefix_caching": self.config.enable_prefix_caching,
                "cache_dtype": str(self.loaded.dtype).removeprefix("torch."),
                "gpu_memory_utilization": self.config.gpu_memory_utilization}

    def snapshot(self) -> dict:
        """Everything a learner may want to see, as one JSON-able dict."""
        bytes_per_slot = KVCache.bytes_per_block(self.loaded.model.config, 1, self.loaded.dtype)
        return {"block_size": self.block_size, "num_blocks": self.block_manager.num_blocks,
                **self.stats_collector.snapshot(
                    bytes_per_slot, speculating=self.config.speculative_config is not None),
                "card": self.worker.card.describe()}
