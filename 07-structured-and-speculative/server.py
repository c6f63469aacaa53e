"""Chapter 07: structured outputs and speculative decoding.

Chapter 06's server, with chapter 05's engine and two parts swapped in
(`engine_parts` below):

- common/structured_output/manager.py (xgrammar): `response_format` and
  vLLM's `structured_outputs` become a grammar whose token mask is applied
  to the logits before the sampler (common/layers/token_bitmask.py);
- with `--speculative-config`, common/spec_decode/speculative.py: n-gram
  drafts (common/spec_decode/ngram_proposer.py) checked in one forward
  pass by the rejection sampler (common/layers/rejection_sampler.py),
  scheduled by chapter 05's scheduler with drafts (`with_drafts`).

Quantization and tensor parallelism are chapter 08's: refused here by name.

    python 07-structured-and-speculative/server.py --device-memory-gb 1.1
    python 07-structured-and-speculative/server.py \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataclasses import replace  # noqa: E402

from common.config import EngineConfig  # noqa: E402
from common.engine.parts import EngineParts  # noqa: E402
from common.entrypoints.api_server import main  # noqa: E402
from common.entrypoints.chapters import chapter_server  # noqa: E402
from common.spec_decode.speculative import with_drafts  # noqa: E402  ch07
from common.structured_output.manager import StructuredOutputManager  # noqa: E402  ch07

def engine_parts(config: EngineConfig) -> EngineParts:
    """Chapter 06's parts (chapter 05's engine), plus the grammar's logits
    processor, and with --speculative-config the drafts."""
    parts = replace(chapter_server("06").engine_parts(config),
                    structured_output_cls=StructuredOutputManager)  # ch07: the grammar's mask
    if config.speculative_config is not None:  # ch07: the scheduler with drafts, their sampler
        parts = with_drafts(parts, config.speculative_config)
    return parts


if __name__ == "__main__":
    sys.exit(main("07", "Chapter 07: structured outputs and speculative decoding",
                  engine_parts))
