"""The servers' command lines (ch01; later chapters add flags), as `vllm serve` spells them.

`server_parser` is every chapter's: `--host`, `--port`, the HTTP deadlines
(common/entrypoints/launcher.py) and the engine flags (common/config.py).
`api_server_parser` adds chapter 06's `--api-key`, `--max-waiting` and
`--disable-fastapi-docs`; chapter 09's `--data-parallel-size` and
`--engine-core`. `parse_server_args` refuses, by name, a flag that a
later chapter adds (the table is common/entrypoints/chapters.py).
Starting the engine where the flags say is chat_server.py's `build_engine`.

Left out: vLLM's config files (`--config`), SSL flags, `--uds`.
"""
from __future__ import annotations

import argparse
import logging
from enum import StrEnum

from common.config import add_engine_args, resolve_model_flags
from common.entrypoints.chapters import (
    FLAG_CHAPTERS,
    hide_later_flags,
    not_in_chapter,
    refuse_later_flags,
)
from common.entrypoints.launcher import add_http_args

DEFAULT_MAX_WAITING = 256


class EngineCoreMode(StrEnum):
    """`--engine-core` (ch09): where the engine runs."""
    PROCESS = "process"  # processes of its own, over ZeroMQ (vLLM v1's default)
    IN_PROCESS = "in-process"  # a thread of the API server's process (ch03-08)


def server_parser(description: str, chapter: str = "08",
                  enable_prefix_caching: bool | None = None) -> argparse.ArgumentParser:
    """Chapter `chapter`'s flags (a later chapter's are hidden from `--help`).
    `enable_prefix_caching`: the flag's default (None: on from chapter 05,
    as in vLLM's current engine)."""
    if enable_prefix_caching is None:
        enable_prefix_caching = chapter >= "05"
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--live-view", action="store_true",
                        help="watch the engine in the browser at /ui/: its KV blocks, "
                             "queues and batch, one frame per step (`make watch`)")
    add_http_args(parser)
    add_engine_args(parser, enable_prefix_caching)
    hide_later_flags(parser, chapter)
    return parser


def api_server_parser(description: str = "Chapter 06: the OpenAI-compatible server",
                      chapter: str = "06") -> argparse.ArgumentParser:
    """Chapter 06's flags on: chapter 05's, plus the API's."""
    p = server_parser(description, chapter)
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and "
                        "/detokenize (default: open)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="most requests waiting for the scheduler; more get HTTP 503")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json")
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load counts the requests in flight (vLLM's flag)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="GET /tokenizer_info: the tokenizer's settings and chat template "
                        "(vLLM's flag)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="top logprobs per token a request may ask for, sampled or of "
                        "the prompt; -1: the whole vocabulary (vLLM's flag)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the "
                        "prefix cache held (vLLM's flag)")
    if chapter >= "09":
        add_scale_out_args(p)
    return p


def add_scale_out_args(parser: argparse.ArgumentParser) -> None:
    """Chapter 09's flags: the engine in processes of its own, N of them."""
    parser.add_argument("--engine-core", type=EngineCoreMode, default=EngineCoreMode.PROCESS,
                        choices=list(EngineCoreMode),
                        help="where the engine runs: in processes of its own over ZeroMQ "
                             "(vLLM v1's way), or on a thread of the server (ch03-08)")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine processes, each with the whole model and its own KV "
                             "cache, pinned to its share of the cores (vLLM's flag)")


def parse_server_args(parser: argparse.ArgumentParser, chapter: str,
                      argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked: a later chapter's flag (`--api-key` given to
    chapter 05, `--quantization` to chapter 06) is a usage error that
    names the chapter adding it, whether this chapter's parser knows the
    flag or not."""
    args, unknown = parser.parse_known_args(argv)
    for token in unknown:
        flag = token.split("=", 1)[0]
        if FLAG_CHAPTERS.get(flag, "00") > chapter:
            parser.error(not_in_chapter(flag, chapter, FLAG_CHAPTERS[flag]))
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    resolve_model_flags(parser, args)
    refuse_later_flags(parser, args, chapter)
    check_scale_out_args(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return args


def check_scale_out_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """ch09: the flags that cannot go together, as usage errors."""
    mode = getattr(args, "engine_core", EngineCoreMode.IN_PROCESS)
    if getattr(args, "data_parallel_size", 1) < 1:
        parser.error("--data-parallel-size must be at least 1")
    if mode is EngineCoreMode.IN_PROCESS and getattr(args, "data_parallel_size", 1) > 1:
        parser.error("--data-parallel-size > 1 runs engines in processes of their own: "
                     "leave out --engine-core in-process")
