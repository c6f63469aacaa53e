"""Chapter 05: continuous batching.

Chapter 04's parts with one swapped: the scheduler
(common/core/scheduler.py's `ContinuousScheduler`). At every step the
running sequences decode one token each, waiting ones join as soon as
blocks and budgets allow, finished ones leave at once; long prompts are
prefilled in chunks; when blocks run out the newest sequence is preempted
and recomputed later. Prefix caching (chapter 04) is on by default, as in
vLLM's current engine: `--no-enable-prefix-caching` turns it off.

    python 05-continuous-batching/server.py --device-memory-gb 1.1
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import EngineConfig  # noqa: E402
from common.core.block_manager import BlockManager  # noqa: E402
from common.core.scheduler import ContinuousScheduler  # noqa: E402
from common.engine.parts import EngineParts  # noqa: E402
from common.entrypoints.chat_server import run_chat_server  # noqa: E402
from common.metrics.stats import StatsCollector  # noqa: E402
from common.metrics.step_events import StepEvents  # noqa: E402
from common.worker.model_runner import PlainSampling  # noqa: E402

def engine_parts(config: EngineConfig) -> EngineParts:
    """What chapter 05 plugs into the engine."""
    return EngineParts(
        scheduler_cls=ContinuousScheduler,  # ch05: iteration-level scheduling
        block_manager_cls=BlockManager,  # ch04: blocks on demand, prefix caching
        sampling_cls=PlainSampling,  # ch03: the sampler, one token per sequence
        stats_collector_cls=StatsCollector,  # ch03: /stats; ch05: preemptions
        step_events_cls=StepEvents)  # ch03: --live-view, --record-events


if __name__ == "__main__":
    sys.exit(run_chat_server("05", "Chapter 05: continuous batching",  # ch05: prefix caching on
                             engine_parts))
