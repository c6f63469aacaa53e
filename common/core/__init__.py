"""The teaching core (ch03-05), vLLM's vllm/v1/core: the bookkeeping, no tensors.

sequence.py (a request's tokens and state), block_manager.py (which KV
blocks each sequence holds; ch03's regions, ch04's small blocks and prefix
caching), scheduler.py (who runs each step: static batches ch03-04,
continuous batching ch05). Nothing here runs the model: the tests drive it
with fake model outputs, as vLLM's do."""
