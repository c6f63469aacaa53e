"""EngineParts: what a chapter plugs into the engine; `assemble_engine` builds it (ch03).

Each chapter's `server.py` is its own composition root: a small
`engine_parts(config)` names the classes the chapter plugs in, and
`assemble_engine` builds them, in this order, and hands them to
`LLMEngine`, which wires nothing itself:

    model       loaded once (or the caller's: the tests share one)
    worker      rank 0's device, weights, card and KV cache, and its
                ModelRunner with the chapter's sampling step and logits
                processors (ch08: ranks 1..N-1 in processes of their own)
    blocks      parts.block_manager_cls over the cache's blocks (ch04;
                ch03's block is a whole region of max_model_len slots)
    scheduler   parts.scheduler_cls (ch03-04 static, ch05 continuous,
                ch07 with drafts)
    observers   the figures (StatsCollector), then the step events when
                a flag asks for them (--record-events, --kv-events-config)

The parts are classes, not instances: chapter 09 sends them to an engine
process, which builds its own engine from them (they pickle by name).

Left out: vLLM's `VllmConfig` tree (one `EngineConfig` holds the flags),
executors for several nodes, plugins found by entry point.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from common.autoregressive import eos_token_ids
from common.config import EngineConfig
from common.core.block_manager import BlockManager
from common.core.scheduler import ContinuousScheduler, Scheduler
from common.engine.llm_engine import LOG_INTERVAL_S, LLMEngine
from common.engine.output_processor import OutputProcessor
from common.loader import LoadedModel, load_model
from common.metrics.stats import StatsCollector
from common.metrics.step_events import JsonlRecorder, StepEvents, recording_path
from common.models import check_tensor_parallel
from common.worker.model_runner import PlainSampling
from common.worker.worker import build_worker


@dataclass(frozen=True)
class EngineParts:
    """The classes a chapter plugs in. Each default is the finished
    engine's (chapters 05-06); a chapter names what it changes."""
    # who runs each step, and how many tokens each (a class, or a partial
    # of one: chapter 07's drafts take the speculative config)
    scheduler_cls: Callable[..., Scheduler] = ContinuousScheduler
    # the KV blocks' bookkeeping (ch04: blocks on demand, prefix caching)
    block_manager_cls: type[BlockManager] = BlockManager
    # the model runner's sampling step (ch07: the rejection sampler's)
    sampling_cls: Callable[[], PlainSampling] = PlainSampling
    # ch07: the grammar's logits processor (a StructuredOutputManager)
    structured_output_cls: type | None = None
    # tokens -> text, stops, deltas (ch09's engine process: token ids only)
    output_processor_cls: type[OutputProcessor] = OutputProcessor
    # the observers: the figures, and the frames a viewer watches
    stats_collector_cls: type[StatsCollector] = StatsCollector
    step_events_cls: type[StepEvents] = StepEvents
    # ch10: the LoRA slots beside the model's products (a partial of
    # common/lora/model_manager.py's LoRAModelManager), None: no adapters
    adapters_cls: Callable | None = None


def assemble_engine(config: EngineConfig, parts: EngineParts = EngineParts(), *,
                    loaded: LoadedModel | None = None, num_blocks: int | None = None,
                    log_interval_s: float = LOG_INTERVAL_S, attention_ops=None,
                    quant_ops=None, data_parallel_rank: int = 0) -> LLMEngine:
    """Build `parts` for `config` and hand them to an `LLMEngine`.

    `loaded`: the caller's model (the tests' shared one; HF's forward must
    still run on it, so its plain weights stay). `num_blocks`: a fixed
    cache size (tests) instead of sizing it from the card.
    `attention_ops`, `quant_ops`: the layers' operations, replaceable (the
    exercises put the learner's in; default: picked for the device).
    `data_parallel_rank`: which of chapter 09's engine processes this is."""
    shared = loaded is not None
    loaded = loaded or load_model(config.model, config.dtype, config.device,
                                  config.load_format, config.seed)
    model_config = loaded.model.config
    max_model_len = config.context_length(loaded.max_model_len)
    block_size = config.block_size or max_model_len  # ch03: a block = a whole region
    check_tensor_parallel(model_config, config.tensor_parallel_size, config.quantization)  # ch08
    eos = eos_token_ids(loaded.model, loaded.tokenizer)
    structured_output = None
    if parts.structured_output_cls is not None:  # ch07: the grammar's masks
        spec = config.speculative_config
        structured_output = parts.structured_output_cls(
            loaded.tokenizer, model_config.vocab_size, sorted(eos),
            spec.num_speculative_tokens if spec else 0)
    build = partial(build_worker, config, 0, block_size, num_blocks, loaded=loaded,
                    model_shared=shared, attention_ops=attention_ops, quant_ops=quant_ops,
                    sampling=parts.sampling_cls(),
                    logits_processors=(structured_output,) if structured_output else (),
                    adapters_cls=parts.adapters_cls)
    tp_workers = None
    if config.tensor_parallel_size > 1:  # ch08: ranks 1..N-1, a process each
        from common.worker.tp_workers import start_ranks
        tp_workers = start_ranks(config, block_size, num_blocks)
    worker = tp_workers.build_rank0(build) if tp_workers else build()  # rank 0
    block_manager = parts.block_manager_cls(worker.kv_cache.num_blocks, block_size,
                                            config.enable_prefix_caching)
    scheduler = parts.scheduler_cls(block_manager, config.max_num_seqs,
                                    config.max_num_batched_tokens, eos, max_model_len,
                                    long_prefill_token_threshold=config.prefill_cap)
    stats_collector = parts.stats_collector_cls(scheduler, block_manager,
                                                config.enable_prefix_caching, log_interval_s)
    engine = LLMEngine(config, loaded, worker, scheduler,
                       parts.output_processor_cls(loaded.tokenizer),
                       stats_collector, structured_output, tp_workers, parts.step_events_cls,
                       data_parallel_rank)
    watch_if_asked(engine, config, data_parallel_rank)
    return engine


def watch_if_asked(engine: LLMEngine, config: EngineConfig, data_parallel_rank: int = 0) -> None:
    """The step events that flags ask for from the start: vLLM's KV events
    (`--kv-events-config`), a recording (`--record-events`). Chapter 09's
    engine N publishes on the port + N and records to FILE_dpN.jsonl."""
    kv_events = config.kv_events_config
    if kv_events is not None and kv_events.publishes:
        engine.enable_step_events().publish_kv_events(kv_events, data_parallel_rank)
    if config.record_events:
        path = recording_path(config.record_events, data_parallel_rank)
        engine.enable_step_events().subscribe(JsonlRecorder(path, engine.describe()))
