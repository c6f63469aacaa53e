"""SamplingParams: how to pick the tokens of one request (ch03).

vLLM's names and defaults. The entrypoints build one from each request
(after validating it: the engine trusts what it is given); the engine and
the sampler only read it.

`output_kind` says what the request receives as it runs (vLLM's
`RequestOutputKind`): only the final output (the offline `LLM`, ch05), or
a delta per new token (the servers, which stream or collect the deltas).
Either way no output copies the whole sequence at every token.

`structured_outputs` (ch07) constrains the answer to a JSON schema, any
JSON object, a regular expression, an EBNF grammar or one of a list of
strings (vLLM's `StructuredOutputsParams`, the same field names): the
engine compiles it with xgrammar (common/structured_output/manager.py).

Left out: beam search, best_of, the cumulative output kind (every output
repeating all the text so far), vLLM's structural tags and
`disable_any_whitespace`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


# vLLM's _SAMPLING_EPS: a temperature below it samples greedily. Dividing the
# logits by 1e-300 would overflow them to inf, and softmax to NaN.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the answer must match (ch06): exactly one of the fields (vLLM's names).

    - `json`: a JSON schema, as a dict or its text;
    - `json_object`: any JSON object (OpenAI's `{"type": "json_object"}`);
    - `regex`: a regular expression the whole answer matches;
    - `choice`: the answer is one of these strings;
    - `grammar`: an EBNF grammar (xgrammar's dialect, GBNF-like).
    """
    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, "
                             f"regex, choice and grammar (given: {given or 'none'})")
        if self.choice is not None and not self.choice:
            raise ValueError("choice needs at least one string")

    @property
    def kind(self) -> str:
        """Which constraint it is: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(name for name in ("json", "json_object", "regex", "choice", "grammar")
                    if getattr(self, name) not in (None, False))


class RequestOutputKind(enum.Enum):
    DELTA = "delta"  # one output per new token: the new token ids and text
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to pick tokens for one request (vLLM's names and defaults)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return (0: chosen only)
    # each prompt token's logprob and this many top ones (vLLM's; -1: the vocabulary)
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    structured_outputs: StructuredOutputsParams | None = None  # ch07: what the answer must match

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError("prompt_logprobs must be -1 (the vocabulary) or >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to adjust or report: a batched argmax serves it."""
        return (self.greedy and not self.needs_penalties and not self.logit_bias
                and self.logprobs is None)  # a grammar's mask is applied before: still plain
