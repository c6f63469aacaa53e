"""Chapter 06: the OpenAI-compatible server.

Switches on: common/entrypoints/api_server.py (streaming, /v1/completions, n, stop
strings, logprobs, tokenize, errors, API key, backpressure, cancellation)
and common/entrypoints/metrics.py (Prometheus, vLLM's names), on chapter 05's engine.
Structured outputs and speculative decoding are chapter 07's; quantization
and tensor parallelism chapter 08's: asked for here, they are refused by name.

    python 06-openai-server/server.py --device-memory-gb 1.1
    python 06-openai-server/server.py --host 0.0.0.0 --api-key secret   # on the network
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.entrypoints.api_server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("06", "Chapter 06: the OpenAI-compatible server"))  # ch06: the API on ch05's engine
