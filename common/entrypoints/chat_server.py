"""The chat server around the engine, shared by chapters 03, 04 and 05.

Each chapter's server.py only says which components it switches on: the
block size (a contiguous region in ch03, small blocks in ch04) and the
scheduling policy (static batches in ch03-04, continuous in ch05). Adds
`GET /stats`: KV reserved vs used, waste, queues, preemptions.

Left out: streaming and the rest of the OpenAI API (chapter 06).
"""
from __future__ import annotations

import logging

from common.config import config_from_args
from common.engine.llm_engine import AsyncLLMEngine, LLMEngine
from common.loader import apply_chat_template
from common.entrypoints.protocol import (APIError, ChatCompletionRequest, Completion, SamplingFields,
                               build_chat_app, new_id, run_server, server_parser)
from common.sampling_params import SamplingParams


def sampling_params_from_request(req: SamplingFields, max_tokens: int, seed_offset: int = 0,
                                 logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams from an OpenAI request (ch03-06)."""
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k if req.top_k > 0 else -1,  # 0 and -1 both mean off, as in vLLM
        min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        seed=None if req.seed is None else req.seed + seed_offset,
        max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop_strings(),
        stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=logprobs)


def main(title: str, policy: str, contiguous: bool = False, max_num_seqs: int | None = None) -> None:
    """Parse the flags, build the engine with the chapter's switches, serve."""
    args = server_parser(title).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = config_from_args(args)
    if max_num_seqs is not None:
        config.max_num_seqs = max_num_seqs
    async_engine = AsyncLLMEngine.build(lambda: LLMEngine(
        config, policy=policy, block_size_is_max_model_len=contiguous))
    engine = async_engine.engine
    tokenizer = engine.tokenizer

    async def generate(prompt_ids: list[int], req: ChatCompletionRequest,
                       max_tokens: int) -> Completion:
        params = sampling_params_from_request(req, max_tokens)
        try:
            async for output in async_engine.generate(new_id("req"), prompt_ids, params):
                last = output
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return Completion(last.token_ids, last.finish_reason)

    app = build_chat_app(title, config.model_name, engine.max_model_len, tokenizer, generate,
                         lambda messages: apply_chat_template(tokenizer, messages))
    app.get("/stats")(async_engine.snapshot)
    run_server(app, args.host, args.port)
