"""The instructor's demo (`make demo`): the naive server falls over, the engine does not.

1. Chapter 02 (`model.generate`, a static cache per request) on the demo
   card, two clients at once: one answer, one CUDA-style out-of-memory
   error (what `make demo-oom` shows).
2. Chapter 05 (paged blocks, continuous batching) on the same card with
   the live view on: it prints the view's URL and waits for Enter (open
   the page on the projector first), then serves the same two clients
   plus 30 more. Blocks fill, requests queue, join and leave, the newest
   are preempted when blocks run out; every request finishes.
3. The server stays up until Enter or Ctrl-C, so the class can pause the
   view and step back through the last steps.

Without a terminal (CI, a script) it does not wait.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench import loadtest

EXTRA_CLIENTS = 30


def pause(message: str) -> None:
    """Wait for Enter when a person is watching."""
    if sys.stdin.isatty():
        try:
            input(message)
        except (EOFError, KeyboardInterrupt):
            print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", type=float, default=1.1, help="the demo card, GiB")
    parser.add_argument("--port", type=int, default=8000, help="chapter 05's port (the view's URL)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    card = ["--device-memory-gb", str(args.card), "--dtype", args.dtype]

    print(f"== 1. chapter 02 on a {args.card} GiB card, 2 clients at once ==", flush=True)
    loadtest.main(["--chapter", "02", "--clients", "2", "--max-tokens", str(args.max_tokens),
                   *card])

    clients = 2 + EXTRA_CLIENTS
    print(f"\n== 2. chapter 05 on the same card, {clients} clients, the live view on ==",
          flush=True)
    log_path = Path(tempfile.gettempdir()) / f"demo-ch05-{args.port}.log"
    with loadtest.ChapterServer("05", args.port, [*card, "--live-view"], log_path) as server:
        print(f"live view: open {server.url}/ui/ in a browser", flush=True)
        pause("press Enter to send the load ")
        summary = loadtest.run_load(server.url, clients, 1, args.max_tokens)
        print(loadtest.format_table(summary))
        print(f"{summary['completed']} of {clients} requests finished, "
              f"{summary['failed']} failed; the server is still up: pause the view and "
              "step back through the steps.", flush=True)
        pause("press Enter to stop the server ")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
