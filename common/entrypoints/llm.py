"""The offline API, like vLLM's `LLM` (ch05).

    from common.entrypoints.llm import LLM
    from common.sampling_params import SamplingParams
    llm = LLM(model="smollm2", chapter="05")   # chapter 05's engine parts
    outputs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)

All prompts are checked (`LLMEngine.check_request`: this is an
entrypoint, the engine trusts what it is given), then handed to the engine
at once; continuous batching runs them together, and a tqdm bar counts
finished requests. Each request asks only for its final output. Prompts
may be strings, token id lists, or (with `LLM.chat`) chat message lists.
Each answer is the engine's own final `RequestOutput` (common/outputs.py,
vLLM's shape), with the prompt's text added.

`LLM.beam_search` (ch06) runs beam_search.py's search over this engine:
each step's beams of every prompt go through `generate` together.

Left out: pooling/embedding models.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING

from tqdm import tqdm

from common.config import EngineConfig
from common.engine.parts import assemble_engine
from common.entrypoints.chapters import chapter_server, refuse_later_engine_args
from common.loader import LoadedModel, apply_chat_template
from common.outputs import RequestOutput
from common.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # chapter 06's, imported when used: chapter 05 runs without it
    from common.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams


class LLM:
    def __init__(self, model: str = "smollm2", loaded: LoadedModel | None = None,
                 chapter: str = "08", **engine_args):
        """`chapter`: whose engine (05 on): the parts its server.py names
        (`engine_parts`); an engine argument that a later chapter adds
        (`speculative_config` for chapter 05) is a TypeError."""
        names = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_args) - names
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        refuse_later_engine_args(engine_args, chapter)
        config = EngineConfig(model=model, **engine_args)
        parts = chapter_server(chapter).engine_parts(config)
        self.engine = assemble_engine(config, parts, loaded=loaded)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def _to_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        return list(prompt)

    def generate(self, prompts: str | list[int] | list, sampling_params:
                 SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.
        `lora_request` (ch10): a LoRARequest for every prompt, or one each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        requests = []
        for prompt, p in zip(prompts, params_list):
            token_ids = self._to_ids(prompt)
            self.engine.check_request(len(token_ids), p)  # all refused before any runs
            requests.append((token_ids, replace(p, output_kind=RequestOutputKind.FINAL_ONLY)))
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        ids = []
        for (token_ids, p), lora in zip(requests, loras):
            self._counter += 1
            request_id = str(self._counter)
            self.engine.add_request(request_id, token_ids, p, lora_request=lora)
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [replace(finished[rid], prompt=prompt if isinstance(prompt, str) else None)
                for rid, prompt in zip(ids, prompts)]

    def beam_search(self, prompts: list[str | list[int]],
                    params: "BeamSearchParams") -> list["BeamSearchOutput"]:
        """vLLM's `LLM.beam_search(prompts, BeamSearchParams(...))`: each
        prompt's best beams (`BeamSearchOutput`, best first)."""
        from common.entrypoints.beam_search import (BeamSearchOutput, BeamSearchSequence,
                                                    best_beams, next_beams, step_params)
        prompt_ids = [self._to_ids(p) for p in prompts]
        live = [[BeamSearchSequence(ids)] for ids in prompt_ids]  # per prompt
        done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for _ in range(params.max_tokens):
            beams = [(k, beam) for k, beams in enumerate(live) for beam in beams]
            if not beams:
                break
            outputs = self.generate([beam.tokens for _, beam in beams], step_params(params),
                                    use_tqdm=False)
            live = [next_beams(live[k], [o for (j, _), o in zip(beams, outputs) if j == k],
                               params, self.tokenizer.eos_token_id, done[k])
                    for k in range(len(prompts))]
        return [BeamSearchOutput(best_beams(done[k], live[k], params, len(ids), self.tokenizer))
                for k, ids in enumerate(prompt_ids)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """One conversation or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.tokenizer, c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)
