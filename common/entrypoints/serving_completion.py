"""`POST /v1/completions`: text completions on the engine (ch06).

One request, top to bottom (`create_completion`):

    model name -> the prompts (a string, several strings, token ids or
    several lists of ids; tokenized in a worker thread) -> `start`: n
    engine requests per prompt (common/entrypoints/serving_engine.py)
    -> whole answers: one final output per choice -> one JSON response
    -> or (`stream: true`) SSE: a chunk per delta as the engine makes it
       (a chunk is a `CompletionResponse` with this step's text), the
       finish reason in each choice's last chunk, the usage chunk if
       asked, `[DONE]`.

Logprobs in OpenAI's text-completion shape: tokens, their logprobs, the
top logprobs as {token: logprob} (the sampled token included), and each
token's character offset in the choice's text.

vLLM's `prompt_logprobs` (ch06): each prompt token's logprob, rank and
top ones, from the prefill (the engine's `SamplingParams.prompt_logprobs`):
their mean, negated and exponentiated, is the text's perplexity.

Left out: `echo`, `suffix`, `best_of` > n.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from common.engine.async_llm import RequestStream
from common.entrypoints.beam_search import BeamSearchParams, beam_search
from common.entrypoints.middleware import APIError, cancel_on_disconnect
from common.entrypoints.protocol import CompletionRequest
from common.entrypoints.responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
    new_id,
    prompt_logprobs,
    sse,
)
from common.entrypoints.request_checks import usage
from common.entrypoints.serving_engine import OpenAIServing, event_stream
from common.layers.sampler import SampledToken
from common.outputs import RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    """Text completions (vLLM's class name)."""

    async def create_completion(self, req: CompletionRequest, request: Request):
        lora_request = self.lora_request(req.model)  # ch10: the adapter `model` names
        prompts = await run_in_threadpool(self.completion_prompts, req)
        await self.compile_grammar(req)  # ch07: structured outputs, off the event loop
        request_id = new_id("cmpl")
        if req.use_beam_search:  # vLLM's: the front searches, the engine steps
            return await cancel_on_disconnect(request, self.beam_search_completion(
                request_id, prompts, req, lora_request))
        streams = self.start(request_id, prompts, req, "prompt", lora_request)
        if req.stream:
            return event_stream(self.completion_stream(request_id, prompts, req, streams),
                                streams, request)
        answers = await self.answers(request, streams, req.n)
        return CompletionResponse(
            id=request_id, created=int(time.time()), model=self.response_model(req.model),
            choices=[self.completion_choice(i, a, prompts[i // req.n], req)
                     for i, a in enumerate(answers)],
            usage=usage(prompts, sum(a.outputs[0].num_output_tokens for a in answers),
                        self.prompt_details(prompts, answers[::req.n])))

    async def beam_search_completion(self, request_id: str, prompts: list[list[int]],
                                     req: CompletionRequest, lora_request=None
                                     ) -> CompletionResponse:
        """`use_beam_search`: `n` beams per prompt (beam_search.py); choice
        k * n + i is prompt k's i-th best beam."""
        searches = []
        for k, ids in enumerate(prompts):
            checked = self.sampling_params(req, ids, 0, "prompt")  # every rule, once
            params = BeamSearchParams(beam_width=req.n, max_tokens=checked.max_tokens,
                                      ignore_eos=req.ignore_eos, temperature=req.temperature,
                                      length_penalty=req.length_penalty)
            searches.append(beam_search(self.engine, f"{request_id}-{k}", ids, params,
                                        lora_request))
        outputs = await asyncio.gather(*searches)
        choices, generated = [], 0
        for k, (ids, output) in enumerate(zip(prompts, outputs)):
            for i, beam in enumerate(output.sequences):
                answer = beam.tokens[len(ids):]
                generated += len(answer)
                choices.append(CompletionChoice(
                    index=k * req.n + i, text=beam.text, finish_reason=beam.finish_reason,
                    token_ids=answer if req.return_token_ids else None,
                    prompt_token_ids=ids if req.return_token_ids else None))
        return CompletionResponse(id=request_id, created=int(time.time()),
                                  model=self.response_model(req.model), choices=choices,
                                  usage=usage(prompts, generated))

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """A prompt, several prompts, token ids or several lists of ids
        (in a worker thread: tokenizing may take a while)."""
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]  # one prompt
        if not prompt or any(len(p) == 0 for p in prompt):
            raise APIError(400, "Either prompt or prompt_embeds must be provided and "
                                "non-empty.", param="prompt")  # vLLM's words
        return [self.encode(p) if isinstance(p, str) else self.check_token_ids(p, "prompt")
                for p in prompt]

    def completion_choice(self, index: int, answer: RequestOutput, prompt: list[int],
                          req: CompletionRequest) -> CompletionChoice:
        out = answer.outputs[0]
        logprobs = None if req.logprobs is None else self.completion_logprobs(out.logprobs, 0)
        ids = req.return_token_ids
        return CompletionChoice(index=index, text=out.text, logprobs=logprobs,
                                finish_reason=out.finish_reason,
                                token_ids=out.token_ids if ids else None,
                                prompt_token_ids=prompt if ids else None,
                                prompt_logprobs=prompt_logprobs(answer.prompt_logprobs,
                                                                self.token_text))

    async def completion_stream(self, request_id: str, prompts: list[list[int]],
                                req: CompletionRequest,
                                streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage, continuous_usage = req.usage_in_stream()
        generated = [0] * len(streams)  # each choice's tokens so far
        outputs: list[RequestOutput | None] = [None] * len(streams)  # each choice's first

        def chunk(choices: list[CompletionChunkChoice], usage: Usage | None = None) -> str:
            return sse(CompletionChunk(id=request_id, created=created,
                                       model=self.response_model(req.model), choices=choices,
                                       usage=usage))

        token_chars = [0] * len(streams)  # the text of the tokens so far, per choice (text_offset)
        first = [True] * len(streams)  # prompt_token_ids go in each choice's first chunk
        ids = req.return_token_ids
        async for i, answer in self.outputs(streams, req.n):  # each output is a delta
            out = answer.outputs[0]
            generated[i] = out.num_output_tokens
            outputs[i] = outputs[i] or answer
            new_logprobs = out.logprobs if req.logprobs is not None else []
            if out.text or new_logprobs or out.finished or (ids and out.token_ids):
                logprobs = (self.completion_logprobs(new_logprobs, token_chars[i])
                            if req.logprobs is not None else None)
                if logprobs is not None:
                    token_chars[i] += sum(map(len, logprobs.tokens))
                prompt = prompts[i // req.n] if ids and first[i] else None
                first[i] = False
                yield chunk([CompletionChunkChoice(index=i, text=out.text, logprobs=logprobs,
                                                   finish_reason=out.finish_reason,
                                                   token_ids=out.token_ids if ids else None,
                                                   prompt_token_ids=prompt)],
                            # vLLM's continuous_usage_stats: this choice's usage so far
                            usage([prompts[i // req.n]], generated[i]) if continuous_usage
                            else None)
        if include_usage:
            yield chunk([], usage(prompts, sum(generated),
                                  self.prompt_details(prompts, outputs[::req.n],
                                                      with_created=False)))

    def completion_logprobs(self, tokens: list[SampledToken], offset: int) -> CompletionLogprobs:
        """`offset`: characters of this choice's tokens before these ones (their
        own text, not what has been released: a stop string holds text back).
        Each position's top logprobs include the sampled token, as OpenAI's
        and vLLM's do (up to `logprobs` + 1 entries)."""
        texts = [self.token_text(t.token_id) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        tops = []
        for text, t in zip(texts, tokens):
            top = {self.token_text(i): lp for i, lp in t.top_logprobs}
            top.setdefault(text, t.logprob)
            tops.append(top)
        return CompletionLogprobs(tokens=texts, token_logprobs=[t.logprob for t in tokens],
                                  top_logprobs=tops, text_offset=offsets)
