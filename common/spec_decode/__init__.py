"""Speculative decoding (ch07), vLLM's vllm/v1/spec_decode.

ngram_proposer.py (drafts from the sequence's own n-grams) and
speculative.py (the scheduler with drafts, the sampling step that checks
them with common/layers/rejection_sampler.py; `with_drafts` swaps both
into a chapter's EngineParts). Imported only by chapter 07 on."""
