"""Output processing (ch03, ch05): new tokens -> text -> what each request receives.

After each step the engine hands the sequences that got a token to
`OutputProcessor.process`, which for each of them (and for each of its
new tokens: one, or with speculative decoding, ch07, up to k + 1)

1. detokenizes the new token incrementally (common/engine/detokenizer.py,
   ch05: a token may hold half a UTF-8 character);
2. looks for the request's stop strings in the new text only (plus the
   few characters held back before it), so the work per token does not
   grow with the answer; nor with the number of stop strings: they are
   searched at once, by an Aho-Corasick automaton built once per request
   (`StopStrings`, pyahocorasick). Text that could be the start of a stop
   string is held back, never sent, and a stop string is cut off the
   answer;
3. builds the request's `RequestOutput`: with `RequestOutputKind.DELTA`
   (streams) the new tokens and text of this step, with `FINAL_ONLY`
   (whole answers, the offline `LLM`) everything, once, when the request
   finishes; the prompt's logprobs, if asked, go in its first output;
4. (ch06) times the new token into the step's `IterationStats`
   (common/metrics/stats.py), whatever the output kind: the time to first
   token or the gap since the request's previous token, all at the
   step's one timestamp, and a `FinishedRequestStats` when the request
   finishes (e2e, queue, prefill, decode and inference times, time per
   output token). The engine hands them to its stat loggers: a request
   that receives one output still has every inter-token latency measured.

It also returns the sequences to finish now (a stop string matched); an
exception while processing one sequence finishes that request with an
error, and the other requests of the step are not touched.

Left out: vLLM's cumulative output kind, `include_stop_str_in_output`,
per-request `skip_special_tokens`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ahocorasick

from common.engine.detokenizer import IncrementalDetokenizer
from common.core.sequence import Sequence
from common.metrics.stats import IterationStats, RequestStateStats
from common.outputs import CompletionOutput, FinishReason, RequestOutput
from common.sampling_params import RequestOutputKind

log = logging.getLogger("llm-course")


class StopStrings:
    """A request's stop strings in one Aho-Corasick automaton, built once:
    a search costs the length of the text searched, however many strings
    the request gave (thousands fit in the 1 MiB body limit)."""

    def __init__(self, stops: list[str]):
        self.automaton = ahocorasick.Automaton()
        for stop in stops:
            self.automaton.add_word(stop, len(stop))
        self.automaton.make_automaton()
        self.hold_chars = max(map(len, stops)) - 1  # a match may start this far back

    def find(self, text: str) -> int | None:
        """Where the earliest stop string starts in `text`, or None."""
        starts = [end - length + 1 for end, length in self.automaton.iter(text)]
        return min(starts, default=None)


@dataclass
class RequestState:
    """The output side of one running request."""
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    released: list[str] = field(default_factory=list)  # text pieces sent (or to send)
    held: str = ""  # decoded, not released: could be the start of a stop string
    stops: StopStrings | None = None  # None: the request has no stop strings
    num_processed: int = 0  # output tokens already turned into text
    stats: RequestStateStats = field(init=False)  # ch06: its times, across steps

    def __post_init__(self) -> None:
        self.stats = RequestStateStats(self.seq.arrival_time)

    @property
    def hold_chars(self) -> int:
        return self.stops.hold_chars if self.stops is not None else 0


@dataclass
class Finish:
    """A sequence the engine must finish now (the scheduler frees its blocks)."""
    seq: Sequence
    reason: FinishReason
    error: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, seq: Sequence) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer)  # ch05: whole characters only
        state = RequestState(seq, detokenizer)
        if seq.params.stop:
            state.stops = StopStrings(seq.params.stop)
        self.states[seq.request_id] = state

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def finish(self, request_id: str, reason: FinishReason,
               iteration_stats: IterationStats) -> None:
        """ch09: a request that the API process finished (it matched a stop
        string): recorded as finished, with its latencies, in `iteration_stats`."""
        state = self.states.pop(request_id, None)
        if state is not None:
            self._record_finished(iteration_stats, state, reason)

    def process(self, seqs: list[Sequence], iteration_stats: IterationStats | None = None
                ) -> tuple[list[RequestOutput], list[Finish]]:
        """Outputs for the sequences that got a token (or failed) this step,
        and the sequences to finish now: a stop string matched, or
        processing failed. `iteration_stats` (the engine's, one per step):
        where each new token is timed and each finished request recorded."""
        outputs, to_finish = [], []
        for seq in seqs:
            state = self.states[seq.request_id]
            reason, error, new_text = seq.finish_reason, seq.error, ""
            if error is None:  # a row that failed to sample has no new token
                try:
                    new_text, stop_matched = self._new_texts(state, reason is not None)
                    if stop_matched:
                        reason = FinishReason.STOP
                        to_finish.append(Finish(seq, reason))
                except Exception as exc:  # noqa: BLE001 - this request's error only
                    log.exception("output processing failed for %s", seq.request_id)
                    reason, error = FinishReason.ERROR, f"output processing failed: {exc!r}"
                    to_finish.append(Finish(seq, reason, error))
            num_new = seq.num_output_tokens - state.num_processed  # after a stop string's cut
            if iteration_stats is not None and num_new:
                iteration_stats.update_from_output(state.stats, seq.first_scheduled_time, num_new,
                                                   seq.num_prompt_tokens, seq.num_cached_tokens)
            state.num_processed = seq.num_output_tokens
            output = self._output(state, new_text, num_new, reason, error)
            if output is not None:
                outputs.append(output)
            if reason is not None:
                del self.states[seq.request_id]
                if iteration_stats is not None:
                    self._record_finished(iteration_stats, state, reason)
        return outputs, to_finish

    @staticmethod
    def _record_finished(iteration_stats: IterationStats, state: RequestState,
                         reason: FinishReason) -> None:
        seq = state.seq
        iteration_stats.update_from_finished_request(
            seq.request_id, reason, seq.num_prompt_tokens, seq.params.max_tokens,
            state.stats, seq.num_preemptions)

    def _new_texts(self, state: RequestState, finishing: bool) -> tuple[str, bool]:
        """Text to release for the step's new tokens, and whether a stop
        string matched. ch06: when one matches at a token that is not the
        last (speculative decoding), the tokens after it are dropped."""
        seq, texts = state.seq, []
        for i in range(state.num_processed, seq.num_output_tokens):
            last = i == seq.num_output_tokens - 1
            text, stop_matched = self._new_text(state, seq.output_token_ids[i], finishing and last)
            texts.append(text)
            if stop_matched:
                seq.truncate_output(i + 1)
                return "".join(texts), True
        return "".join(texts), False

    def _new_text(self, state: RequestState, token_id: int, finishing: bool
                  ) -> tuple[str, bool]:
        """Text to release for one new token, and whether a stop string
        matched. Only `held + new` is searched: a stop string that ends in
        the new text starts at most `hold_chars` characters before it."""
        text = state.held + state.detokenizer.step(token_id)
        if finishing:
            text += state.detokenizer.flush()
        position = state.stops.find(text) if state.stops is not None else None
        if position is not None:
            state.held = ""
            return self._release(state, text[:position]), True
        keep = 0 if finishing else min(state.hold_chars, len(text))
        state.held = text[len(text) - keep:]
        return self._release(state, text[:len(text) - keep]), False

    @staticmethod
    def _release(state: RequestState, text: str) -> str:
        if text:
            state.released.append(text)
        return text

    @staticmethod
    def _output(state: RequestState, new_text: str, num_new: int, reason: FinishReason | None,
                error: str | None) -> RequestOutput | None:
        seq = state.seq
        if seq.params.output_kind is RequestOutputKind.DELTA:
            return request_output(seq, new_text, seq.num_output_tokens - num_new, reason, error,
                                  seq.prompt_token_ids)
        if reason is None:
            return None
        return request_output(seq, "".join(state.released), 0, reason, error,  # FINAL_ONLY:
                              seq.prompt_token_ids)  # the whole answer, once


def request_output(seq: Sequence, text: str, first: int, reason: FinishReason | None,
                   error: str | None, prompt_token_ids: list[int]) -> RequestOutput:
    """seq's output tokens from number `first` on (and their logprobs), with
    `text`; ch06: the prompt's logprobs in the request's first output."""
    completion = CompletionOutput(0, text, seq.output_token_ids[first:],
                                  seq.output_logprobs[first:], reason, seq.num_output_tokens, error)
    prompt_logprobs = seq.prompt_logprobs if seq.wants_prompt_logprobs and not first else None
    return RequestOutput(seq.request_id, None, prompt_token_ids, [completion], reason is not None,
                         seq.num_cached_tokens, prompt_logprobs)
