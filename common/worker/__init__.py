"""The worker (ch03-08), vLLM's vllm/v1/worker: one rank's device and tensors.

kv_cache.py (the KV tensors, sized from the card, ch03), model_runner.py
(a step's inputs, the forward pass, the sampling step), worker.py (a rank:
device, weights, card, cache, runner), cuda_graphs.py (ch05, on CUDA) and
tp_workers.py (ch08: ranks 1..N-1 in processes of their own, imported only
with --tensor-parallel-size above 1)."""
