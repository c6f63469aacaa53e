"""Chapter 03: our own forward pass and an explicit KV cache.

The engine's first parts, named in `engine_parts` below: our forward pass
(common/models/), the KV cache sized from the card
(common/worker/kv_cache.py), the sampler (common/layers/sampler.py), and a
scheduler that runs one request at a time. Each sequence reserves one
contiguous region of max_model_len slots (a "block" as big as the
context); requests that find no free region wait in a FIFO queue.
GET /stats shows reserved vs used slots (the waste).

    python 03-kv-cache/server.py --device-memory-gb 1.1
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import EngineConfig  # noqa: E402
from common.core.block_manager import BlockManager  # noqa: E402
from common.core.scheduler import StaticScheduler  # noqa: E402
from common.engine.parts import EngineParts  # noqa: E402
from common.entrypoints.chat_server import run_chat_server  # noqa: E402
from common.metrics.stats import StatsCollector  # noqa: E402
from common.metrics.step_events import StepEvents  # noqa: E402
from common.worker.model_runner import PlainSampling  # noqa: E402

def engine_parts(config: EngineConfig) -> EngineParts:
    """What chapter 03 plugs into the engine."""
    return EngineParts(
        scheduler_cls=StaticScheduler,  # ch03: one batch at a time (of one request)
        block_manager_cls=BlockManager,  # ch03: one region of max_model_len slots each
        sampling_cls=PlainSampling,  # ch03: the sampler, one token per sequence
        stats_collector_cls=StatsCollector,  # ch03: /stats, reserved vs used slots
        step_events_cls=StepEvents)  # ch03: --live-view, --record-events


if __name__ == "__main__":
    sys.exit(run_chat_server("03", "Chapter 03: our forward pass and a contiguous KV cache",
                             engine_parts,
                             max_num_seqs=1,  # ch03: one request at a time
                             block_size=None))  # ch03: a block of max_model_len slots per request
