"""The engine (ch03-08): requests in, tokens out. No web server here:
sequence, block manager, scheduler, model runner, output processing, the
figures it keeps (stats.py: StatsCollector), LLMEngine and its async front
(AsyncLLM), and a Worker per rank (worker.py: the device, the weights, the
KV cache, the ModelRunner). Chapter 07 adds the grammar step
(structured_output.py) and speculation (spec_decode.py, ngram_proposer.py);
chapter 08 the tensor-parallel processes (tp_workers.py) and the quantized
model (--quantization)."""
