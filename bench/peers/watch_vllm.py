"""`make watch-vllm`: the real vLLM with its KV events on, and the live view of its prefix cache.

vLLM's `--kv-events-config` publishes which blocks its prefix cache holds
(vllm/distributed/kv_events.py); the course's live view subscribes to
them (`python -m common.entrypoints.live_view --kv-events ...`) and draws
that cache: the hashes stored and removed, step by step. vLLM says which
hashes it caches, not where they live or who uses them, so the page has
no block ids, no queues, no batch: the course's own step events (chapter
05's `make watch`) are what vLLM has no equivalent of.

    make watch-vllm PORT=8000    # vLLM on :8000, its live view on :8001/ui/
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.peers.vllm_peer import VllmServer
from common.net import free_port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000, help="vLLM's; the view on the next one")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    kv_port = free_port()
    flag = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{kv_port}"})
    log = Path(f"/tmp/vllm-watch-{args.port}.log")
    print(f"starting the real vLLM with --kv-events-config '{flag}' (1-2 min; log: {log})",
          flush=True)
    with VllmServer(args.port, log, args.dtype, extra=["--kv-events-config", flag]) as vllm:
        print(f"vLLM: {vllm.url}/v1 (send it requests; prompts over 128 tokens fill blocks)",
              flush=True)
        from common.entrypoints.live_view import main as live_view
        return live_view(["--kv-events", f"tcp://127.0.0.1:{kv_port}",
                          "--port", str(args.port + 1)])


if __name__ == "__main__":
    sys.exit(main())
