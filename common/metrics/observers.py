"""StepObserver: what the engine tells, after each phase of a step (ch03).

`LLMEngine.step()` runs the same four phases for every chapter and then
tells each of its observers, in order, what happened:

    observe_scheduled(batch)                  before the forward pass
    observe_sampled(batch, sampled)           after it, before the scheduler appends
    observe_step(iteration_stats, outputs)    after the outputs are processed

The observers are the engine's figures (`StatsCollector`, stats.py: the
totals, the stat loggers, the log line) and, when something watches the
engine, its step events (`StepEvents`, step_events.py: the live view's
frames, recordings, vLLM's KV events). An observer reads; it never
changes the scheduler, the blocks or the outputs.

Left out: vLLM's separate hooks for each stat logger (here a logger is
fed by `StatsCollector`, one observer among these).
"""
from __future__ import annotations


class StepObserver:
    """The three hooks, each a no-op until a subclass needs it."""

    def observe_scheduled(self, batch: list) -> None:
        """The step's batch (ScheduledSeq items), before the forward pass."""

    def observe_sampled(self, batch: list, sampled: dict) -> None:
        """The tokens each sequence got, before the scheduler takes them in."""

    def observe_step(self, iteration_stats, outputs: list) -> None:
        """The step's IterationStats and RequestOutputs, once processed."""

    def close(self) -> None:
        """The engine is closing: stop what runs beside it (publishers)."""
