"""Structured outputs (ch07), vLLM's vllm/v1/structured_output.

manager.py: the StructuredOutputManager, which compiles a request's
grammar with xgrammar and masks the logits of constrained rows (the mask
is applied by common/layers/token_bitmask.py). Imported only by chapter 07
on: chapters 01-06 run without xgrammar."""
