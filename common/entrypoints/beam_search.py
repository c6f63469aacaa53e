"""Beam search at the front, as vLLM v1 runs it (ch06): over the engine's logprobs.

vLLM v1 took beam search out of its engine: the scheduler knows nothing
of beams. The front runs it (vLLM's vllm/entrypoints/generate/beam_search/),
one token at a time:

1. every live beam (the prompt, then the tokens it chose) is one engine
   request for one token, with its `2 x beam_width` most likely next
   tokens and their logprobs;
2. each (beam, next token) is a candidate, ranked by its beam's summed
   logprob plus the token's; a candidate whose token is EOS is done; the
   best `beam_width` others are the next step's beams;
3. after `max_tokens` steps (or when no beam is left), the done and the
   live beams are ranked by score = summed logprob / length **
   length_penalty (HF's), and the best `beam_width` are the answer.

Each step's requests are whole token lists that share their beginnings.
With prefix caching (ch04), a step finds the beams' shared history in the
cache, block for block: only the last, partly filled block is computed
again. The live view shows it: the beams' requests hold the same blocks
(a block's reference count is the number of beams that share it). That
is the PagedAttention paper's copy-on-write story, with the cache's hash
table doing the sharing.

`next_beams` and `best_beams` are the step and the end, with no engine;
`beam_search` drives them over the server's engine (online);
`LLM.beam_search` drives them over the offline engine.

Left out: streaming (vLLM refuses it too), beam search on chat, logprobs
and stop strings in a beam search (only EOS ends a beam), a stop to the
search once no live beam can beat the done ones (vLLM runs every step).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.outputs import RequestOutput
from common.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from common.engine.async_llm import AsyncLLM


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's names: `n` of the request is the beam width."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0


@dataclass
class BeamSearchSequence:
    """One beam: its whole token list (the prompt's first; a beam that
    chose EOS ends there, without it) and their summed logprob."""
    tokens: list[int]
    cum_logprob: float = 0.0
    finish_reason: str = "length"  # "stop": it chose EOS
    text: str = ""  # the answer's text, once it is among the best


@dataclass
class BeamSearchOutput:
    """vLLM's: a prompt's best beams, best first."""
    sequences: list[BeamSearchSequence] = field(default_factory=list)


def step_params(params: BeamSearchParams) -> SamplingParams:
    """One engine request per beam per step: one token, its top 2 x width logprobs."""
    return SamplingParams(max_tokens=1, temperature=params.temperature,
                          logprobs=2 * params.beam_width,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def score(beam: BeamSearchSequence, length_penalty: float) -> float:
    """vLLM's `get_beam_search_score` (HF's): the summed logprob over the
    whole length, the prompt's included, to the power length_penalty."""
    return beam.cum_logprob / max(len(beam.tokens), 1) ** length_penalty


def next_beams(beams: list[BeamSearchSequence], outputs: list[RequestOutput],
               params: BeamSearchParams, eos_token_id: int,
               done: list[BeamSearchSequence]) -> list[BeamSearchSequence]:
    """One step: `outputs[i]` is beam i's one-token answer. Candidates that
    end in EOS join `done`; the best `beam_width` others are returned."""
    candidates: list[tuple[float, int, BeamSearchSequence]] = []
    for beam, output in zip(beams, outputs):
        sampled = output.outputs[0].logprobs[0]  # the one token, and the top ones
        top = dict(sampled.top_logprobs or [])
        top.setdefault(sampled.token_id, sampled.logprob)
        for token_id, logprob in top.items():
            total = beam.cum_logprob + logprob
            if token_id == eos_token_id and not params.ignore_eos:
                done.append(BeamSearchSequence(beam.tokens, total, "stop"))
            else:
                candidates.append((total, token_id, beam))
    candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam, then token order
    return [BeamSearchSequence(beam.tokens + [token_id], total)
            for total, token_id, beam in candidates[:params.beam_width]]


def best_beams(done: list[BeamSearchSequence], live: list[BeamSearchSequence],
               params: BeamSearchParams, prompt_len: int, tokenizer
               ) -> list[BeamSearchSequence]:
    """The end: the best `beam_width` of all, best first, each with the
    text of its tokens after the prompt."""
    ranked = sorted(done + live, reverse=True, key=lambda b: score(b, params.length_penalty))
    best = ranked[:params.beam_width]
    for beam in best:
        beam.text = tokenizer.decode(beam.tokens[prompt_len:], skip_special_tokens=True)
    return best


async def beam_search(engine: AsyncLLM, request_id: str, prompt_ids: list[int],
                      params: BeamSearchParams, lora_request=None) -> BeamSearchOutput:
    """The search over the server's engine: each step's beams are sent
    together, so the engine batches them (and, with prefix caching, finds
    their shared blocks). `lora_request` (ch10): the adapter of every beam."""
    beams, done = [BeamSearchSequence(list(prompt_ids))], []
    for step in range(params.max_tokens):
        outputs = await asyncio.gather(*(
            final_output(engine, f"{request_id}-step{step}-beam{i}", beam.tokens,
                         step_params(params), lora_request)
            for i, beam in enumerate(beams)))
        beams = next_beams(beams, outputs, params, engine.tokenizer.eos_token_id, done)
        if not beams:
            break
    return BeamSearchOutput(best_beams(done, beams, params, len(prompt_ids),
                                       engine.tokenizer))


async def final_output(engine: AsyncLLM, request_id: str, token_ids: list[int],
                       params: SamplingParams, lora_request=None) -> RequestOutput:
    """One engine request's final output (FINAL_ONLY: its only one)."""
    async for output in engine.generate(request_id, token_ids, params,
                                     lora_request=lora_request):
        if output.finished:
            return output
    raise RuntimeError(f"request {request_id} ended without a final output")
