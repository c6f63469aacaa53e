"""The servers' command lines (ch01; ch06 adds the API flags), as `vllm serve` spells them.

`server_parser` is every chapter's: `--host`, `--port`, the HTTP deadlines
(common/entrypoints/launcher.py) and the engine flags (common/config.py).
`api_server_parser` adds chapter 06's `--api-key`, `--max-waiting` and
`--disable-fastapi-docs`. `build_engine` turns a flag that does not fit
the model (`--tensor-parallel-size 2` for 9 heads) into a usage error.

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


def parse_server_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    resolve_model_flags(parser, args)
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
