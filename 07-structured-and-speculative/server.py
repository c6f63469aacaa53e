"""Chapter 07: structured outputs and speculative decoding.

Chapter 06's server, with two components swapped into the engine:

- common/engine/structured_output.py (xgrammar): `response_format` and
  vLLM's `structured_outputs` become a grammar whose token mask is applied
  to the logits before the sampler (common/layers/token_bitmask.py);
- with `--speculative-config`, common/engine/spec_decode.py: n-gram drafts
  (common/engine/ngram_proposer.py) checked in one forward pass by the
  rejection sampler (common/layers/rejection_sampler.py), scheduled by the
  `SpeculativeScheduler` (chapter 05's, plus drafts).

Quantization and tensor parallelism are chapter 08's: refused here by name.

    python 07-structured-and-speculative/server.py --device-memory-gb 1.1
    python 07-structured-and-speculative/server.py \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.structured_output import StructuredOutputManager  # noqa: E402  ch07: xgrammar
from common.entrypoints.api_server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("07", "Chapter 07: structured outputs and speculative decoding",
                  structured_output_cls=StructuredOutputManager))  # ch07: the grammar's mask
