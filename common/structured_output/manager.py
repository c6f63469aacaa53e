"""Structured outputs (ch07): a grammar per constrained sequence, as a token mask.

`response_format: {"type": "json_schema", ...}` (or vLLM's
`structured_outputs`) becomes a grammar that the answer must follow. The
grammar is compiled by **xgrammar**, the library vLLM uses by default,
against the tokenizer's vocabulary: for every state of the grammar it
knows which tokens may come next (a token is a piece of text, and the
grammar speaks characters: xgrammar works that out once per vocabulary
and caches what does not depend on the state). Each step:

    matcher.fill_next_token_bitmask(bitmask, row)   # (words,) int32: 32 tokens a word
    apply_token_bitmask(logits, bitmask)            # disallowed -> -inf (common/layers/token_bitmask.py)
    token = sampler(logits)                         # any rule: greedy, top-p, ...
    matcher.accept_token(token)                     # the grammar moves on

The end of the answer (EOS) is allowed only where the grammar may end,
and once the grammar has ended only EOS is allowed: so the answer is
complete, or it ran out of `max_tokens` first (`finish_reason: "length"`,
as in vLLM: a schema that no answer of that length satisfies ends there).

Where each piece lives, as in vLLM's v1 (vllm/v1/structured_output/):

- `StructuredOutputManager`: one per engine, swapped in at construction
  (`LLMEngine(structured_output_cls=StructuredOutputManager)`, chapter
  07's server). `compile` turns
  `StructuredOutputsParams` into a compiled grammar (the servers call it
  in a worker thread, before queueing: a bad schema is a 400, and a slow
  compile never stalls the event loop; xgrammar caches each distinct
  grammar, so a schema is compiled once); `grammar_bitmasks` fills the
  masks of a step's constrained rows.
- `StructuredOutputGrammar`: one sequence's matcher. The manager fills
  its rows of the step's bitmask (`fill_bitmask_rows`); it advances with every token the sequence accepts
  (`Sequence.append`). A preempted
  sequence keeps it: preemption drops K/V, not output tokens, and the
  matcher has consumed exactly those.

Speculative decoding (ch07): a sequence checking k drafts gets k + 1 rows
of mask, row j filled after the matcher has accepted drafts 1..j, then
rolled back: the rejection sampler sees the same masked distribution at
every position as plain decoding would.

Left out: vLLM's other backends (guidance, outlines, lm-format-enforcer),
structural tags, reasoning models (a grammar only after the thinking),
compiling asynchronously while the request waits (here the server does
it before queueing), jump-forward decoding.
"""
from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from common.core.scheduler import ScheduledSeq
from common.layers.token_bitmask import allocate_token_bitmask, apply_token_bitmask
from common.sampling_params import StructuredOutputsParams


class GrammarError(ValueError):
    """The constraint could not be compiled (a 400 for the client)."""


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices` (vLLM's way for
    `choice` on xgrammar): root ::= "a" | "b" | ..."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


class StructuredOutputGrammar:
    """One constrained sequence's grammar state (vLLM's name)."""

    def __init__(self, compiled: xgr.CompiledGrammar, max_rollback_tokens: int = 0):
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=max_rollback_tokens)

    def accept_token(self, token_id: int) -> bool:
        """Move on by one token; False (and no move) if the grammar refuses it."""
        if self.matcher.is_terminated():
            return False
        return self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` (rows, words): the tokens allowed next.
        Once the grammar has ended (EOS accepted), xgrammar allows EOS only."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_bitmask_rows(self, bitmask: torch.Tensor, first_row: int,
                          draft_token_ids: list[int] = ()) -> None:
        """Rows first_row .. first_row + len(drafts) of `bitmask`: the tokens
        allowed next, and ch07 (speculative decoding) row j after drafts
        1..j were accepted, then the matcher rolled back to where it was.
        Rows after a draft the grammar refuses stay all-allowed: never used,
        since that draft has probability 0 and is rejected there."""
        accepted = 0
        for j in range(len(draft_token_ids) + 1):
            self.fill_bitmask(bitmask, first_row + j)
            if j == len(draft_token_ids) or not self.accept_token(draft_token_ids[j]):
                break
            accepted += 1
        self.rollback(accepted)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class StructuredOutputManager:
    """The engine's grammar compiler and the masks of each step."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 num_speculative_tokens: int = 0):
        """`vocab_size`: the logits' width (the model's, may exceed the
        tokenizer's); `eos_token_ids`: the tokens that end the answer."""
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1)  # caches
        self.max_rollback_tokens = num_speculative_tokens

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of a constraint (cached by xgrammar: the same
        schema text is compiled once). Raises GrammarError."""
        try:
            if params.json is not None:
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return self.compiler.compile_json_schema(schema)
            if params.json_object:  # any JSON *object*, as vLLM compiles it (not any value)
                return self.compiler.compile_json_schema('{"type": "object"}')
            if params.regex is not None:
                return self.compiler.compile_regex(params.regex)
            if params.choice is not None:
                return self.compiler.compile_grammar(choice_grammar(params.choice))
            return self.compiler.compile_grammar(params.grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and others
            # xgrammar's C++ message starts "[08:00:45] /project/cpp/file.cc:83: ": drop that
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
            raise GrammarError(f"xgrammar could not compile this {params.kind}: "
                               f"{reason[:500]}") from None

    def grammar_for(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A fresh matcher for one sequence (the compile is a cache hit)."""
        return StructuredOutputGrammar(self.compile(params), self.max_rollback_tokens)

    def apply(self, logits: torch.Tensor, sampling: list[ScheduledSeq],
              rows: list[range]) -> None:
        """The model runner's logits step: each constrained sequence's rows
        get its grammar's mask (-inf for the tokens it does not allow); the
        other rows are untouched. A sequence with k + 1 rows (ch07,
        speculative decoding) fed k drafts after its first row's token:
        row j is masked after the grammar has taken drafts 1..j."""
        constrained = [(item, r) for item, r in zip(sampling, rows)
                       if item.seq.structured_output is not None]
        if not constrained:
            return
        row_ids = [row for _, r in constrained for row in r]
        bitmask = allocate_token_bitmask(len(row_ids), logits.shape[-1])  # (rows, words)
        first = 0
        for item, r in constrained:
            fed = item.input_token_ids()
            drafts = fed[len(fed) - len(r) + 1:]  # fed after the first row's token: ch07's drafts
            item.seq.structured_output.fill_bitmask_rows(bitmask, first, drafts)
            first += len(r)
        masked = logits[row_ids]  # (rows, vocab), a copy
        apply_token_bitmask(masked, bitmask.to(logits.device))
        logits[row_ids] = masked
