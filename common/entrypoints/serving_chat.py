"""`POST /v1/chat/completions` on the engine (ch03; streaming ch06).

One request, top to bottom (`create_chat_completion`):

    model name -> chat template (in a worker thread: never on the event
    loop, where it would stall every other request) -> token ids
    -> `start`: one engine request per choice (common/entrypoints/serving_engine.py)
    -> whole answers: one final output per choice -> one JSON response
    -> or (ch06, `stream: true`) SSE: a role chunk per choice, then a chunk
       per delta as the engine makes it (the last with the finish reason,
       as vLLM's), the usage chunk if asked (`stream_options.include_usage`),
       `[DONE]`;
       with vLLM's `continuous_usage_stats` too, every chunk carries its
       choice's usage so far (as vLLM counts it: that choice's tokens).

Chapters 03-05 answer whole; their route refuses `stream: true` (api_server.py).

ch07: `response_format` (JSON object, JSON schema) and vLLM's
`structured_outputs` constrain the answer (common/structured_output/manager.py);
the grammar is compiled before the request is queued.

vLLM's extras: `echo`, `add_generation_prompt`, `continue_final_message`.

Left out: tool calls, `client.beta.chat.completions.parse`'s `refusal` (always null here).
"""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from common.engine.async_llm import RequestStream
from common.entrypoints.protocol import ChatCompletionRequest
from common.entrypoints.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChunkChoice,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    new_id,
    prompt_logprobs,
    sse,
)
from common.entrypoints.request_checks import usage
from common.entrypoints.serving_engine import OpenAIServing, event_stream
from common.layers.sampler import SampledToken
from common.loader import apply_chat_template
from common.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    """Chat completions (vLLM's class name)."""

    async def create_chat_completion(self, req: ChatCompletionRequest, request: Request):
        lora_request = self.lora_request(req.model)  # ch10: the adapter `model` names
        prompt = await run_in_threadpool(self.chat_prompt, req)
        await self.compile_grammar(req)  # ch07: structured outputs, off the event loop
        request_id = new_id("chatcmpl")
        streams = self.start(request_id, [prompt], req, "messages", lora_request)
        if req.stream:  # ch06
            return event_stream(self.chat_stream(request_id, prompt, req, streams), streams,
                                request)
        answers = await self.answers(request, streams, req.n)
        choices = [answer.outputs[0] for answer in answers]
        return ChatCompletionResponse(
            id=request_id, created=int(time.time()), model=self.response_model(req.model),
            choices=[ChatChoice(index=i, message=ResponseMessage(content=self.echoed(req) + a.text),
                                finish_reason=a.finish_reason,
                                logprobs=self.chat_logprobs(a.logprobs) if req.logprobs else None,
                                token_ids=a.token_ids if req.return_token_ids else None)
                     for i, a in enumerate(choices)],
            usage=usage([prompt], sum(a.num_output_tokens for a in choices),
                        self.prompt_details([prompt], answers[:1])),
            prompt_token_ids=prompt if req.return_token_ids else None,
            # vLLM's: the prompt's logprobs (the choices share the prompt: the first's)
            prompt_logprobs=prompt_logprobs(answers[0].prompt_logprobs, self.token_text))

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The messages through the chat template (in a worker thread)."""
        return apply_chat_template(self.tokenizer, req.message_dicts(),
                                   req.add_generation_prompt, req.continue_final_message)

    @staticmethod
    def echoed(req: ChatCompletionRequest) -> str:
        """vLLM's `echo`: the last message, if it is the assistant's, comes
        first in the answer (the text the model went on from)."""
        last = req.messages[-1]
        return last.text() if req.echo and last.role == "assistant" else ""

    # ch06: Server-Sent Events, a chunk per delta.
    async def chat_stream(self, request_id: str, prompt: list[int], req: ChatCompletionRequest,
                          streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage, continuous_usage = req.usage_in_stream()
        generated = [0] * len(streams)  # each choice's tokens so far
        first_choice: RequestOutput | None = None  # its cached tokens are the prompt's

        def chunk(choices: list[ChunkChoice], usage: Usage | None = None,
                  prompt_token_ids: list[int] | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created,
                                           model=self.response_model(req.model),
                                           choices=choices, usage=usage,
                                           prompt_token_ids=prompt_token_ids))

        def so_far(i: int) -> Usage | None:  # vLLM's continuous_usage_stats
            return usage([prompt], generated[i]) if continuous_usage else None

        for i in range(len(streams)):
            yield chunk([ChunkChoice(index=i, delta={"role": "assistant", "content": ""})],
                        so_far(i), prompt if req.return_token_ids and i == 0 else None)
            if self.echoed(req):  # vLLM's echo: the last message, once per choice
                yield chunk([ChunkChoice(index=i, delta={"content": self.echoed(req)})],
                            so_far(i))
        async for i, answer in self.outputs(streams, req.n):  # each output is a delta
            out = answer.outputs[0]
            generated[i] = out.num_output_tokens
            first_choice = answer if i == 0 else first_choice
            new_logprobs = out.logprobs if req.logprobs else []
            # vLLM's shape: the finish reason rides on the last delta (an
            # empty one, {}, if the last step released no text)
            if out.text or new_logprobs or out.finished or (req.return_token_ids
                                                            and out.token_ids):
                yield chunk([ChunkChoice(
                    index=i, delta={"content": out.text} if out.text else {},
                    logprobs=self.chat_logprobs(new_logprobs) if req.logprobs else None,
                    finish_reason=out.finish_reason if out.finished else None,
                    token_ids=out.token_ids if req.return_token_ids else None)], so_far(i))
        if include_usage:
            yield chunk([], usage([prompt], sum(generated), self.prompt_details([prompt], [first_choice])))

    def chat_logprobs(self, tokens: list[SampledToken]) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return ChatLogprobs(content=[
            TokenLogprob(**entry(t.token_id, t.logprob),
                         top_logprobs=[TopLogprob(**entry(i, lp)) for i, lp in t.top_logprobs])
            for t in tokens])
