"""Chapter 05: continuous batching.

Switches on: common/engine/scheduler.py's continuous policy. At every step the
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

from common.engine.scheduler import ContinuousScheduler  # noqa: E402
from common.entrypoints.api_server import run_chat_server  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_chat_server("05", "Chapter 05: continuous batching",  # ch05: prefix caching on
                             scheduler_cls=ContinuousScheduler))  # ch05: iteration-level scheduling
