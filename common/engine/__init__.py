"""The engine (ch03-06): requests in, tokens out. No web server here:
sequence, block manager, scheduler, model runner, output processing,
LLMEngine and its async front; ch06 adds the tensor-parallel ranks
(tp_workers.py) and the quantized model (--quantization)."""
