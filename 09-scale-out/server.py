"""Chapter 09: scale out: the engine in its own process, N of them behind one API server.

Chapter 08's server and engine parts (`engine_parts` below), with the
engine core in processes of its own over ZeroMQ, as vLLM v1 runs it
(common/engine/core.py, the engine's side; common/engine/core_client.py,
the API server's side, which detokenizes):

    python 09-scale-out/server.py --device-memory-gb 1.1                  # 1 engine process
    python 09-scale-out/server.py --data-parallel-size 2                  # 2, a core each
    python 09-scale-out/server.py -dp 2 --live-view                       # a tab per engine
    python 09-scale-out/server.py --engine-core in-process                # ch08's thread

N separate servers behind the chapter's router (common/entrypoints/router.py),
on one machine or on a Ray cluster: see README.md.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import EngineConfig  # noqa: E402
from common.engine.parts import EngineParts  # noqa: E402
from common.entrypoints.api_server import main  # noqa: E402
from common.entrypoints.chapters import chapter_server  # noqa: E402

def engine_parts(config: EngineConfig) -> EngineParts:
    """Chapter 08's parts: where the engine runs (--engine-core,
    --data-parallel-size) is this chapter's, not what it is built from."""
    return chapter_server("08").engine_parts(config)


if __name__ == "__main__":
    sys.exit(main("09", "Chapter 09: scale out",  # ch09: --engine-core, --data-parallel-size
                  engine_parts))
