"""Chapter 06: the OpenAI-compatible server.

Chapter 05's engine, unchanged (its parts: `engine_parts` below), behind
common/entrypoints/api_server.py (streaming, /v1/completions, n, stop
strings, logprobs, tokenize, errors, API key, backpressure, cancellation)
and common/entrypoints/metrics.py (Prometheus, vLLM's names).
Structured outputs and speculative decoding are chapter 07's; quantization
and tensor parallelism chapter 08's: asked for here, they are refused by name.

    python 06-openai-server/server.py --device-memory-gb 1.1
    python 06-openai-server/server.py --host 0.0.0.0 --api-key secret   # on the network
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import EngineConfig  # noqa: E402
from common.engine.parts import EngineParts  # noqa: E402
from common.entrypoints.api_server import main  # noqa: E402
from common.entrypoints.chapters import chapter_server  # noqa: E402

def engine_parts(config: EngineConfig) -> EngineParts:
    """Chapter 05's engine: this chapter adds the API around it."""
    return chapter_server("05").engine_parts(config)


if __name__ == "__main__":
    sys.exit(main("06", "Chapter 06: the OpenAI-compatible server",  # ch06: the API
                  engine_parts))
