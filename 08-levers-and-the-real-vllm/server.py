"""Chapter 08: the levers of `vllm serve`: the course's `vllm serve`.

Chapter 07's server and engine parts (`engine_parts` below), with every
lever as a flag: `--dtype` (float32, bfloat16 where the hardware computes
it), `--quantization int8|int4` (weight-only, common/layers/quantization.py),
`--tensor-parallel-size N` (N ranks, a process each:
common/worker/tp_workers.py, common/layers/parallel.py), `--max-model-len`,
and the card's share (`--gpu-memory-utilization`, `--device-memory-gb`).
The real vLLM runs beside it: `make vllm`, `make vllm-serve`, `make vllm-check`.

    python 08-levers-and-the-real-vllm/server.py --device-memory-gb 1.1 --quantization int8
    python 08-levers-and-the-real-vllm/server.py --tensor-parallel-size 3 --dtype float32
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import EngineConfig  # noqa: E402
from common.engine.parts import EngineParts  # noqa: E402
from common.entrypoints.api_server import main  # noqa: E402
from common.entrypoints.chapters import chapter_server  # noqa: E402

def engine_parts(config: EngineConfig) -> EngineParts:
    """Chapter 07's parts: the levers are flags in `config` (the worker
    quantizes and shards what the flags say), not new parts."""
    return chapter_server("07").engine_parts(config)


if __name__ == "__main__":
    sys.exit(main("08", "Chapter 08: the levers of vllm serve",  # ch08: -q, -tp
                  engine_parts))
