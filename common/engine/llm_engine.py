"""LLMEngine (ch03-08): add_request / step / abort, on the parts it is given.

`LLMEngine.step()` is one iteration, as in nano-vllm, the same in every
chapter:

    batch   = scheduler.schedule()                    # 1 who runs, how many tokens each
    observers: observe_scheduled(batch)
    sampled = model_runner.execute_model(batch)       # 2 one forward pass, one sampling step
    observers: observe_sampled(batch, sampled)
    outputs = self.process_outputs(batch, sampled)    # 3 append, finish, free; text, stops
    observers: observe_step(iteration_stats, outputs) # 4 the figures, the live view

The engine receives its parts built (common/engine/parts.py:
`assemble_engine`, from the chapter's `EngineParts`): the scheduler
(`StaticScheduler` ch03-04, `ContinuousScheduler` ch05, with drafts ch07),
its block manager, rank 0's `Worker` (device, weights, card, KV cache and
the `ModelRunner` with its sampling step and logits processors), the
output processor and the observers (common/metrics/: the figures, and the
step events once something watches). What a chapter switches on is a part,
never a branch in the step.

The engine trusts its requests: the entrypoints (the HTTP servers, the
offline `LLM`) validate each one once with `check_request` before
`add_request`. One request's failure while sampling or processing its
output finishes that request with an error; the others go on.

ch08, `--tensor-parallel-size N`: this process is rank 0 (scheduler,
sampler and output processing run here, once); ranks 1..N-1 run in worker
processes (common/worker/tp_workers.py), stopped in `close()`.

Left out: LoRA, multimodal inputs. The async fronts that servers use are
common/engine/async_llm.py (the engine on a thread of the server's
process) and, chapter 09, common/engine/core_client.py (the engine in a
process of its own: common/engine/core.py).
"""
from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from common.config import EngineConfig
from common.core.block_manager import KVCacheUsage
from common.core.scheduler import Scheduler
from common.core.sequence import Sequence
from common.context_length import DEFAULT_MAX_TOKENS
from common.engine.admission import Admission
from common.engine.output_processor import OutputProcessor
from common.layers.sampler import RequestSamplingState
from common.loader import LoadedModel
from common.metrics.observers import StepObserver
from common.metrics.stats import EngineStats, IterationStats, StatsCollector
from common.metrics.step_events import StepEvents
from common.outputs import FinishReason, RequestOutput
from common.sampling_params import SamplingParams, StructuredOutputsParams
from common.worker.kv_cache import KVCache
from common.worker.model_runner import SampledTokens
from common.worker.worker import RankDiedError, Worker

log = logging.getLogger("llm-course")

LOG_INTERVAL_S = 5.0


def lora_name_and_id(lora_request) -> tuple[str | None, int]:
    """ch10: a request's adapter, its name and id (None, 0: none); from a
    LoRARequest, or from [name, id, path] (how chapter 09's engine process
    gets it)."""
    if lora_request is None:
        return None, 0
    if isinstance(lora_request, list):
        return lora_request[0], lora_request[1]
    return lora_request.lora_name, lora_request.lora_int_id


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, worker: Worker,
                 scheduler: Scheduler, output_processor: OutputProcessor,
                 stats_collector: StatsCollector, structured_output=None, tp_workers=None,
                 step_events_cls: type[StepEvents] = StepEvents, data_parallel_rank: int = 0):
        """The parts, built (common/engine/parts.py: `assemble_engine`).
        `structured_output` (ch07): the grammar step, already among the
        model runner's logits processors; the engine compiles each
        request's grammar with it. `tp_workers` (ch08): ranks 1..N-1.
        `step_events_cls`: what `enable_step_events` adds, when watched.
        `data_parallel_rank` (ch09): which engine process this is; unseeded
        requests draw from a stream of seeds of its own."""
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.vocab_size = min(len(self.tokenizer), loaded.model.config.vocab_size)
        self.worker = worker
        self.model_runner = worker.model_runner
        self.scheduler = scheduler
        self.block_manager = scheduler.bm
        self.block_size = self.block_manager.block_size
        self.max_model_len = scheduler.max_model_len
        self.eos_token_ids = scheduler.eos_token_ids
        self.output_processor = output_processor
        self.stats_collector = stats_collector
        self.observers: list[StepObserver] = [stats_collector]  # + the step events, when watched
        self.structured_output = structured_output
        self.workers = tp_workers
        self.step_events_cls = step_events_cls
        self.step_events: StepEvents | None = None
        self.sequences: dict[str, Sequence] = {}  # unfinished requests
        self._seed_counter = config.seed
        self.data_parallel_rank = data_parallel_rank
        self.started_at = time.time()

    def enable_step_events(self) -> StepEvents:
        """The step's events from now on: one more observer (built once;
        call it between steps)."""
        if self.step_events is None:
            self.step_events = self.step_events_cls(self)
            self.observers = [*self.observers, self.step_events]
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
        for observer in self.observers:
            observer.close()

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
                    params: SamplingParams, arrival_time: float | None = None,
                    lora_request=None) -> None:
        """Queue a request that `check_request` accepted. `arrival_time`
        (`time.monotonic()`, default now): when it reached the engine's
        async front; its time to first token, e2e and queue times run from it.
        `lora_request` (ch10): the adapter it runs with (a LoRARequest)."""
        if request_id in self.sequences:
            raise ValueError(f"duplicate request id {request_id!r}")
        lora_name, lora_int_id = lora_name_and_id(lora_request)
        if lora_request is not None:  # ch10: known to the slots, loaded once
            self.worker.model_runner.adapters.add_adapter(lora_request)
        seed = params.seed
        if seed is None:  # unseeded requests still draw reproducibly per engine
            self._seed_counter += 1  # ch09: engine N's seeds shifted from engine 0's
            # (within 32 bits: a CPU generator's Mersenne Twister keeps no more)
            seed = self._seed_counter * 1_000_003 + self.data_parallel_rank * 7_919
        sampling = RequestSamplingState(  # built once: see common/layers/sampler.py
            params, prompt_token_ids, self.loaded.model.config.vocab_size,
            sorted(self.eos_token_ids), torch.Generator().manual_seed(seed))
        seq = Sequence(request_id, list(prompt_token_ids), params, sampling=sampling,
                       arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                       lora_int_id=lora_int_id, lora_name=lora_name)
        if params.structured_outputs is not None:  # ch07: its own matcher
            seq.structured_output = self.structured_output.grammar_for(params.structured_outputs)
        self.sequences[request_id] = seq
        self.output_processor.add(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Finish a request from outside the step: its client left (ABORT),
        or ch09, the API process matched one of its stop strings (STOP)."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.finish(seq, reason)
        if reason is FinishReason.ABORT:
            self.output_processor.abort(request_id)
            self.stats_collector.observe_finished_between_steps(reason)
            return
        iteration_stats = IterationStats(time.monotonic())  # ch09: its latencies, now
        self.output_processor.finish(request_id, reason, iteration_stats)
        self.stats_collector.observe_finished_between_steps(reason, iteration_stats)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()                             # 1 schedule
        if not batch:
            return []
        for observer in self.observers:
            observer.observe_scheduled(batch)
        sampled = self.model_runner.execute_model(batch)              # 2 execute
        for observer in self.observers:
            observer.observe_sampled(batch, sampled)
        iteration_stats = self.stats_collector.new_iteration()       # every new token's time
        outputs = self.process_outputs(batch, sampled, iteration_stats)  # 3 process outputs
        for observer in self.observers:                               # 4 notify
            observer.observe_step(iteration_stats, outputs)
        return outputs

    def process_outputs(self, batch: list, sampled: SampledTokens,
                        iteration_stats: IterationStats) -> list[RequestOutput]:
        """The scheduler appends the tokens (and finishes, frees); the
        output processor turns them into text, stops and deltas."""
        updated = self.scheduler.update_from_output(batch, sampled)
        outputs, to_finish = self.output_processor.process(updated, iteration_stats)
        for finish in to_finish:  # stop strings, and failures while processing
            self.scheduler.finish(finish.seq, finish.reason, finish.error)
        for output in outputs:
            if output.finished:
                del self.sequences[output.request_id]
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
                "kv_cache_size_tokens": self.block_size * self.block_manager.num_blocks,
                "enable_prefix_caching": self.config.enable_prefix_caching,
                "cache_dtype": str(self.loaded.dtype).removeprefix("torch."),
                "gpu_memory_utilization": self.config.gpu_memory_utilization}

    def snapshot(self) -> dict:
        """Everything a learner may want to see, as one JSON-able dict."""
        bytes_per_slot = KVCache.bytes_per_block(self.loaded.model.config, 1, self.loaded.dtype)
        return {"block_size": self.block_size, "num_blocks": self.block_manager.num_blocks,
                **self.stats_collector.snapshot(
                    bytes_per_slot, speculating=self.config.speculative_config is not None),
                **(self.lora_adapter_counts() if self.config.enable_lora else {}),  # ch10
                "card": self.worker.card.describe()}

    def lora_adapter_counts(self) -> dict:
        """ch10: requests by adapter name, running and waiting (vLLM's
        scheduler stats, shown by vllm:lora_requests_info and the live view)."""
        def by_name(seqs) -> dict[str, int]:
            return dict(Counter(seq.lora_name for seq in seqs if seq.lora_name))
        return {"running_lora_adapters": by_name(self.scheduler.running),
                "waiting_lora_adapters": by_name(self.scheduler.waiting),
                "max_loras": self.config.max_loras,
                "lora_slot_bytes": self.model_runner.adapters.slot_bytes}


def step_or_fail(engine: LLMEngine) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
    """One `engine.step()`, for the loops that drive it (a thread, ch03-08;
    an engine process, ch09). A step that fails as a whole (the forward
    pass) aborts the requests in it: they come back as (request id, error)
    and the engine keeps serving. A tensor-parallel rank that died (ch08:
    `RankDiedError`) is raised: no step can run any more."""
    try:
        return engine.step(), []
    except RankDiedError:
        raise
    except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
        log.exception("engine step failed; aborting the requests in flight")
        failed = [(request_id, f"internal engine error: {exc!r}")
                  for request_id in list(engine.sequences)]
        for request_id, _ in failed:
            engine.abort(request_id)
        return [], failed
