"""Each engine step as an event: what the live view draws, what `--record-events` writes (ch05).

vLLM publishes the prefix cache's changes (KV events, common/metrics/kv_events.py)
and counters; nothing says what a step *did*. The course's step event
does, once per step, as one JSON-able dict (a *frame*):

    step, ts            the step's number (the engine's `num_steps`, as /stats
                        says it) and time.time()
    num_blocks, block_size
    blocks              one letter per KV block: "." free, "c" free but its
                        hash kept (a prefix-cache hit can still take it back),
                        "u" used by one sequence, "s" shared by several
    batch               what the step fed: per request, its tokens and kind
                        ("prefill", a chunk or a whole prompt; "recompute",
                        a preempted request's prompt and output again;
                        "decode", one token; ch07: with its drafts and how
                        many were accepted)
    running             each running request: its tokens and block table (ch10:
                        and its adapter's `lora_name`, as in `batch` and `waiting`)
    waiting, preempted  the queue; `preempted` are the waiting requests
                        that had blocks once and lost them
    finished            requests that left at this step, and why
    kv_events           the step's KV events in vLLM's schema
    lora                ch10, with --enable-lora: requests by adapter, running
                        and waiting, and max_loras (the step's adapter budget)
    figures             tok/s, TTFT and ITL p50, KV usage, preemptions,
                        prefix-cache hit rate (see `Figures`)

The engine builds frames only while `engine.step_events` exists (the live
view, `--record-events FILE` or `--kv-events-config` asked for it): off,
the step does no extra work. Subscribers are called on the engine's
thread and must not block: the live view hands each frame to the event
loop, the recorder appends one line to its file.

Left out: the model's side of a step (which kernels ran, how long the
forward pass took: bench/profile_step.py measures that).
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Callable

from common.metrics.kv_events import (KVEventBatch, KVEventsConfig, KVEventTracker,
                                     ZmqEventPublisher, event_to_dict)
from common.metrics.observers import StepObserver

log = logging.getLogger("llm-course")

Frame = dict
Subscriber = Callable[[Frame], None]

RATE_WINDOW_S = 5.0  # tok/s over the last seconds
LATENCY_WINDOW = 500  # TTFT and ITL p50 over the last values


class Figures:
    """The view's running figures, from each step's `IterationStats`:
    generated tok/s over the last RATE_WINDOW_S seconds, and the median
    time to first token and inter-token latency of the last
    LATENCY_WINDOW values (/metrics has the same latencies since the
    start, as histograms)."""

    def __init__(self):
        self.tokens: deque[tuple[float, int]] = deque()  # (time, tokens generated)
        self.ttfts: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.itls: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def observe(self, iteration_stats) -> None:
        now = iteration_stats.iteration_timestamp
        self.tokens.append((now, iteration_stats.num_generation_tokens))
        while self.tokens and self.tokens[0][0] < now - RATE_WINDOW_S:
            self.tokens.popleft()
        self.ttfts.extend(iteration_stats.time_to_first_tokens_iter)
        self.itls.extend(iteration_stats.inter_token_latencies_iter)

    def as_dict(self) -> dict:
        span = self.tokens[-1][0] - self.tokens[0][0] if len(self.tokens) > 1 else 0.0
        generated = sum(n for _, n in list(self.tokens)[1:])  # tokens after the first stamp
        return {"tokens_per_s": generated / span if span else 0.0,
                "ttft_p50_s": statistics.median(self.ttfts) if self.ttfts else None,
                "itl_p50_s": statistics.median(self.itls) if self.itls else None}


def request_row(seq) -> dict:
    row = {"request_id": seq.request_id, "num_prompt_tokens": seq.num_prompt_tokens,
           "num_output_tokens": seq.num_output_tokens, "num_preemptions": seq.num_preemptions}
    if seq.lora_name:  # ch10: the adapter it runs with (the live view colours by it)
        row["lora_name"] = seq.lora_name
    return row


def block_letters(block_manager) -> str:
    """One letter per block (see the module docstring)."""
    cached = set(block_manager.hash_to_block.values())
    return "".join("s" if b.ref_count > 1 else "u" if b.ref_count else
                   "c" if b.block_id in cached else "." for b in block_manager.blocks)


class StepEvents(StepObserver):
    """Builds a frame after every step and hands it to the subscribers.

    `observe_scheduled(batch)` before the forward pass (the tokens each
    request is about to feed), `observe_step(iteration_stats, outputs)`
    after it: one of the engine's observers once `enable_step_events` added it."""

    def __init__(self, engine):
        self.engine = engine
        self.kv_tracker = KVEventTracker(engine.block_manager)
        self.figures = Figures()
        self.subscribers: list[Subscriber] = []
        self.kv_publisher: ZmqEventPublisher | None = None
        self._batch: list[tuple] = []

    def subscribe(self, subscriber: Subscriber) -> None:
        """Called with every frame, on the engine's thread. The list is
        replaced, never changed in place (another thread may subscribe)."""
        self.subscribers = [*self.subscribers, subscriber]

    def publish_kv_events(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        """`--kv-events-config`: the KV events over ZeroMQ, as vLLM sends them
        (ch09: data-parallel engine N on the port + N)."""
        self.kv_publisher = ZmqEventPublisher(config, data_parallel_rank)
        log.info("publishing KV cache events on %s", self.kv_publisher.endpoint)

    def close(self) -> None:
        if self.kv_publisher is not None:
            self.kv_publisher.shutdown()

    # ------------------------------------------------------------- the step
    def observe_scheduled(self, batch) -> None:
        """What each request feeds: (seq, tokens, computed before, outputs before, drafts)."""
        self._batch = [(item.seq, item.num_new_tokens, item.seq.num_computed_tokens,
                        item.seq.num_output_tokens, len(getattr(item, "draft_token_ids", ())))
                       for item in batch]

    def observe_step(self, iteration_stats, outputs) -> None:
        self.figures.observe(iteration_stats)
        kv_events = self.kv_tracker.take_events([entry[0] for entry in self._batch])
        frame = self.frame(kv_events, outputs)
        if self.kv_publisher is not None and kv_events:
            self.kv_publisher.publish(KVEventBatch(frame["ts"], kv_events,
                                                   self.kv_publisher.data_parallel_rank))
        for subscriber in self.subscribers:
            try:
                subscriber(frame)
            except Exception:  # noqa: BLE001 - a viewer's problem, never the engine's
                log.exception("step event subscriber %r failed", subscriber)

    def frame(self, kv_events, outputs) -> Frame:
        engine = self.engine
        bm, scheduler = engine.block_manager, engine.scheduler
        waiting = list(scheduler.waiting)
        lora = {"lora": engine.lora_adapter_counts()} if engine.config.enable_lora else {}
        return {**lora,  # ch10: the adapters running and waiting, and max_loras
            "type": "step", "step": engine.stats.num_steps, "ts": time.time(),
            "num_blocks": bm.num_blocks, "block_size": bm.block_size,
            "blocks": block_letters(bm),
            "batch": [self.batch_row(*entry) for entry in self._batch],
            "running": [{**request_row(seq), "num_computed_tokens": seq.num_computed_tokens,
                         "num_cached_tokens": seq.num_cached_tokens,
                         "block_table": list(seq.block_table)} for seq in scheduler.running],
            "waiting": [request_row(seq) for seq in waiting if not seq.num_preemptions],
            "preempted": [request_row(seq) for seq in waiting if seq.num_preemptions],
            "finished": [{"request_id": o.request_id,
                          "finish_reason": str(o.outputs[0].finish_reason)}
                         for o in outputs if o.finished],
            "kv_events": [event_to_dict(e) for e in kv_events],
            "figures": {**self.figures.as_dict(),
                        "kv_cache_usage_perc": 100.0 * bm.num_used_blocks / bm.num_blocks,
                        "num_used_blocks": bm.num_used_blocks,
                        "num_preemptions": scheduler.num_preemptions,
                        "prefix_cache_hit_rate": (bm.prefix_hits / bm.prefix_queries
                                                  if bm.prefix_queries else 0.0)},
        }

    @staticmethod
    def batch_row(seq, num_new_tokens: int, computed_before: int, outputs_before: int,
                  num_drafts: int) -> dict:
        """A prompt (a chunk of it) is a prefill; once a request has
        output, feeding only its last token is a decode, and feeding more
        is a recompute (it was preempted: its prompt and output again)."""
        last_token_only = (computed_before == seq.num_prompt_tokens + outputs_before - 1
                           and num_new_tokens == 1 + num_drafts)
        kind = ("prefill" if not outputs_before else
                "decode" if last_token_only else "recompute")
        row = {"request_id": seq.request_id, "kind": kind, "num_tokens": num_new_tokens}
        if seq.lora_name:  # ch10
            row["lora_name"] = seq.lora_name
        if num_drafts:  # ch07: the drafts the step checked, and how many it kept
            row["num_drafts"] = num_drafts
            row["num_accepted"] = max(0, seq.num_output_tokens - outputs_before - 1)
        return row


def recording_path(path: str, data_parallel_rank: int = 0) -> str:
    """ch09: each data-parallel engine records to a file of its own, the
    first to FILE, engine N to FILE_dpN (run.jsonl, run_dp1.jsonl)."""
    if data_parallel_rank == 0:
        return path
    file = Path(path)
    return str(file.with_name(f"{file.stem}_dp{data_parallel_rank}{file.suffix}"))


class JsonlRecorder:
    """`--record-events FILE`: the frames as JSON lines, after a first line
    that describes the engine (`{"type": "config", ...}`); the live view
    replays such a file with no engine (`make watch REPLAY=FILE`)."""

    def __init__(self, path: str, config: dict):
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open while serving
        self.write({"type": "config", **config})

    def __call__(self, frame: Frame) -> None:
        self.write(frame)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self.file.flush()  # a recording cut short by a crash is still readable

    def close(self) -> None:
        self.file.close()
