"""The servers' command lines (ch01; ch06 adds the API flags), as `vllm serve` spells them.

`server_parser` is every chapter's: `--host`, `--port`, the HTTP deadlines
(common/entrypoints/launcher.py) and the engine flags (common/config.py).
`api_server_parser` adds chapter 06's `--api-key`, `--max-waiting` and
`--disable-fastapi-docs`. `build_engine` turns a flag that does not fit
the model (`--tensor-parallel-size 2` for 9 heads) into a usage error, and
`refuse_later_flags` a flag of a later chapter given to chapter 02.

Left out: vLLM's config files (`--config`), SSL flags, `--uds`.
"""
from __future__ import annotations

import argparse
import logging
from typing import Callable

from common.config import ConfigError, add_engine_args, resolve_model_flags
from common.engine.async_llm import AsyncLLM
from common.engine.llm_engine import LLMEngine
from common.entrypoints.launcher import add_http_args

DEFAULT_MAX_WAITING = 256


def server_parser(description: str, enable_prefix_caching: bool = False
                  ) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    add_http_args(parser)
    add_engine_args(parser, enable_prefix_caching)
    return parser


def api_server_parser() -> argparse.ArgumentParser:
    """Chapter 06's flags: chapter 05's, plus the API's."""
    p = server_parser("Chapter 06: the OpenAI-compatible server (like `vllm serve`)",
                      enable_prefix_caching=True)  # as chapter 05, and vLLM
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and "
                        "/detokenize (default: open)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="most requests waiting for the scheduler; more get HTTP 503")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json")
    return p


# The flags of later chapters, and the chapter that adds each: chapter 02
# refuses them rather than ignore them. Not here: --max-num-seqs and
# --max-num-batched-tokens, which `make bench` passes to every chapter alike
# (chapter 02 has no scheduler for them to limit).
FLAG_CHAPTERS = {"--block-size": "04", "--enable-prefix-caching": "04",
                 "--long-prefill-token-threshold": "05", "--enforce-eager": "05",
                 "--quantization": "06", "--tensor-parallel-size": "06",
                 "--speculative-config": "06"}


def refuse_later_flags(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       chapter: str) -> None:
    """ch02: a usage error (exit 2) for a flag that a later chapter adds, set
    to anything but its default (left at it, it changes nothing)."""
    for flag, adds in FLAG_CHAPTERS.items():
        dest = flag.removeprefix("--").replace("-", "_")
        if adds > chapter and getattr(args, dest) != parser.get_default(dest):
            parser.error(f"{flag} is not implemented in chapter {chapter}: "
                         f"chapter {adds} adds it")


def parse_server_args(parser: argparse.ArgumentParser,
                      chapter: str | None = None) -> argparse.Namespace:
    """The flags, checked; `chapter` ("02"): refuse the flags of later chapters."""
    args = parser.parse_args()
    resolve_model_flags(parser, args)
    if chapter is not None:
        refuse_later_flags(parser, args, chapter)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return args


def build_engine(parser: argparse.ArgumentParser,
                 factory: Callable[[], LLMEngine]) -> AsyncLLM:
    """`AsyncLLM.build`, where flags that do not fit the model
    (`--tensor-parallel-size 2` for 9 heads, ch06) exit as a usage error."""
    try:
        return AsyncLLM.build(factory)
    except ConfigError as exc:
        parser.error(str(exc))
