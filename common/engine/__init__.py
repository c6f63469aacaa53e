"""The engine (ch03-06): requests in, tokens out. No web server here:
sequence, block manager, scheduler, model runner, output processing, the
stats it times (stats.py), LLMEngine and its async front (AsyncLLM), and a
Worker per rank (worker.py: the device, the weights, the KV cache, the
ModelRunner); ch08 adds the tensor-parallel processes (tp_workers.py) and
the quantized model (--quantization)."""
