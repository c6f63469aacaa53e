"""What the engine tells about itself (ch03-06), vLLM's vllm/v1/metrics.

observers.py (the step's three hooks), stats.py (the figures: totals, each
step's IterationStats for the stat loggers, the log line), step_events.py
(a frame per step: the live view, --record-events) and kv_events.py
(vLLM's KV cache events, published over ZeroMQ only with
--kv-events-config). Chapter 06's Prometheus exporter is a server's:
common/entrypoints/metrics.py."""
