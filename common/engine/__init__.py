"""The engine (ch03-09), vLLM's vllm/v1/engine: requests in, outputs out. No web server.

parts.py (what a chapter plugs in, and `assemble_engine`, which builds
it), llm_engine.py (`LLMEngine`: add_request, step, abort, on the parts it
is given), admission.py (what may run at all), output_processor.py and
detokenizer.py (tokens to text, stops, deltas), async_llm.py (ch03: the
engine on a thread, behind async streams). Chapter 09: core.py (the
engine in a process of its own), core_client.py (the API server's side)
and serial.py (msgpack between them)."""
