"""Chapter 03: our own forward pass and an explicit KV cache.

Switches on: common/models/ (our forward), common/engine/kv_cache.py (the cache,
sized from the card), common/layers/sampler.py. Each sequence reserves one
contiguous region of max_model_len slots (a "block" as big as the context);
requests that find no free region wait in a FIFO queue. One request is
decoded at a time. GET /stats shows reserved vs used slots (the waste).

    python 03-kv-cache/server.py --device-memory-gb 1.1
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.scheduler import StaticScheduler  # noqa: E402
from common.entrypoints.api_server import run_chat_server  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_chat_server("03", "Chapter 03: our forward pass and a contiguous KV cache",
                             scheduler_cls=StaticScheduler,  # ch03: one batch at a time...
                             max_num_seqs=1,  # ch03: ...of one request
                             block_size=None))  # ch03: a block of max_model_len slots per request
