"""Chapter 04: PagedAttention with static batching.

Chapter 03's parts, with the KV cache cut into blocks of --block-size
tokens handed out on demand (common/core/block_manager.py; prefix caching
with --enable-prefix-caching), read through block tables by the paged
kernels (common/layers/triton_kernels.py on CUDA). The waiting requests
are grouped into one batch, as many as the blocks allow at their worst
case; the batch runs until all of them finish; new arrivals wait for the
whole batch.

    python 04-paged-attention/server.py --device-memory-gb 1.1 --enable-prefix-caching
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import EngineConfig  # noqa: E402
from common.engine.parts import EngineParts  # noqa: E402
from common.entrypoints.chapters import chapter_server  # noqa: E402
from common.entrypoints.chat_server import run_chat_server  # noqa: E402

def engine_parts(config: EngineConfig) -> EngineParts:
    """Chapter 03's parts: the same block manager, now with small blocks
    (--block-size, in `config`), and the same static scheduler, now
    batching as many requests as the blocks allow (--max-num-seqs)."""
    return chapter_server("03").engine_parts(config)


if __name__ == "__main__":
    sys.exit(run_chat_server("04", "Chapter 04: paged attention, static batching",
                             engine_parts,  # ch04: small blocks (--block-size), whole batches
                             disable_cascade_attn=True))  # chapter 05 adds cascade attention
