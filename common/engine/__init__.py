"""The engine (ch03-05): requests in, tokens out. No web server here:
sequence, block manager, scheduler, model runner, output processing,
LLMEngine and its async front."""
