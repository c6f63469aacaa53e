"""How requests reach the engine (ch01, ch05, ch06): the OpenAI protocol,
the chat server of chapters 01-05, the full OpenAI server, its metrics,
and the offline `LLM` (an entrypoint too, as in vLLM)."""
