"""How requests reach the engine (ch01-06), one concern per module, as in vLLM:
the wire (protocol.py in, responses.py out), the HTTP edge (middleware.py),
the serving core and one module per endpoint (serving_*.py), the routes
(api_server.py; chapter 01's own app in simple_app.py), the command line
(cli_args.py, launcher.py), the metrics, and the offline `LLM` (llm.py:
an entrypoint too, as in vLLM)."""
