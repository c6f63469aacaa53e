"""Chapter 04: PagedAttention with static batching.

Switches on: common/engine/block_manager.py (blocks of --block-size tokens handed
out on demand, prefix caching with --enable-prefix-caching),
common/layers/triton_kernels.py on CUDA. The waiting requests are grouped into one
batch, as many as the blocks allow at their worst case; the batch runs
until all of them finish; new arrivals wait for the whole batch.

    python 04-paged-attention/server.py --device-memory-gb 1.1 --enable-prefix-caching
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.scheduler import StaticScheduler  # noqa: E402
from common.entrypoints.api_server import run_chat_server  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_chat_server("04", "Chapter 04: paged attention, static batching",
                             scheduler_cls=StaticScheduler))  # ch04: small blocks (--block-size), whole batches
