"""What a client sends: the OpenAI request models, validated as strictly as OpenAI (ch01).

- pydantic models for `/v1/chat/completions` (ch01) and `/v1/completions`
  (ch06), shaped like OpenAI's and vLLM's (`/tokenize`'s: serving_tokenization.py);
- strict types (strict.py): `"max_tokens": "8"` or `true` is a 400, not 8
  or 1; a seed fits in 64 bits; text is valid Unicode; a stop string is
  never empty; `stream_options` needs `"stream": true`;
- fields this server does not implement (tools, completions' `echo`,
  `suffix`, beam search, audio...) are refused by name (a 400 naming its
  `param`), never silently ignored; unknown fields are ignored, as OpenAI
  and vLLM do. What needs the model (token ids in the vocabulary, the
  context length) is checked by the serving code; answers: responses.py.

ch07, structured outputs: `response_format` (OpenAI's `text`,
`json_object`, `json_schema`) and vLLM's `structured_outputs` extra
(`json`, `json_object`, `regex`, `choice`, `grammar`) become one
`StructuredOutputsParams` (`SamplingFields.structured_outputs_params`).

Left out: tools, audio and images, the Responses API, vLLM's structural tags.
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, ValidationInfo, field_validator

from common.entrypoints.response_format import ResponseFormat, StructuredOutputsRequest
from common.entrypoints.strict import INT64_MAX, INT64_MIN, StrictModel, Text, unsupported
from common.sampling_params import StructuredOutputsParams


# ---------------------------------------------------------------- requests
class TextPart(StrictModel):
    type: Literal["text"] = "text"
    text: Text


class ChatMessage(StrictModel):
    role: Text  # OpenAI's (system, user, assistant, ...) or any other: the chat template takes it
    content: Union[Text, Annotated[list[TextPart], Field(min_length=1)]]  # required, as OpenAI

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_dict(self) -> dict:
        """{"role", "content"}: what a chat template takes."""
        return {"role": self.role, "content": self.text()}


class StreamOptions(StrictModel):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk too (with include_usage)


class SamplingFields(StrictModel):
    """Fields shared by chat and text completions."""
    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: Union[Text, list[Text], None] = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: Text | None = None
    # vLLM's extras
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    return_token_ids: bool = False  # the prompt's and the answer's token ids, beside the text
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs, this many top (-1: all)
    use_beam_search: bool = False  # vLLM's: n beams (on /v1/completions; ch06)
    length_penalty: float = 1.0  # vLLM's, for beam search: score = logprob / length ** this
    # ch07: structured outputs, OpenAI's way or vLLM's (not both)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    LOGPROBS_PARAM: ClassVar[str]  # the field asking for the answer's top logprobs (for a 400)

    @field_validator("use_beam_search")
    @classmethod
    def _beam_search_not_streamed(cls, value, info: ValidationInfo):
        if value and info.data.get("stream"):  # vLLM's words
            raise unsupported("Streaming is not currently supported with beam search")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value, info: ValidationInfo):  # vLLM's rules and words
        if info.data.get("stream") and value is not None and (value > 0 or value == -1):
            raise unsupported("`prompt_logprobs` are not available when `stream=True`.")
        if value is not None and value < -1:
            raise unsupported("`prompt_logprobs` must be a positive value or -1.")
        return value

    @field_validator("response_format")
    @classmethod
    def _free_text_is_the_default(cls, value):
        """`{"type": "text"}` asks for nothing: the same as no response_format."""
        return None if value is not None and value.type == "text" else value

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value, info: ValidationInfo):
        response_format = info.data.get("response_format")
        if value is not None and response_format is not None and response_format.type != "text":
            raise unsupported("response_format and structured_outputs may not both "
                              "constrain the answer: give one.")
        return value

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str]:
        """ch07: what the answer must match (None: free text), and the
        request field that said so (the `param` of a 400 about it)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.params(), "structured_outputs"
        if self.response_format is not None:
            return self.response_format.params(), "response_format"
        return None, "response_format"

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise unsupported("stream_options is only allowed when stream is true.")
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value):
        if value == "" or (isinstance(value, list) and "" in value):
            raise unsupported("A stop string may not be empty.")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        # ASCII digits, a few: "²".isdigit() is true, int() refuses 4,301 digits.
        # Every bad key named at once (vLLM's words), not only the first.
        bad = [key[:32] for key in value or {}
               if not (key.isascii() and key.isdigit() and len(key) <= 9)]
        if bad:
            raise unsupported(f"logit_bias contains key(s) that cannot be converted to "
                              f"integer token IDs: {bad!r}")
        return value

    def usage_in_stream(self) -> tuple[bool, bool]:
        """(a last chunk with the usage, the usage in every chunk too): vLLM's
        rule, `continuous_usage_stats` counts only beside `include_usage`."""
        include_usage = self.stream_options is not None and self.stream_options.include_usage
        return include_usage, include_usage and self.stream_options.continuous_usage_stats

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def prompt_logprobs_count(self) -> int | None:
        return self.prompt_logprobs


class ChatTemplateFlags(StrictModel):
    """vLLM's chat-template extras (chat and /tokenize): the assistant's
    turn opened by the template, or instead the last message left open."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _not_both(cls, value, info: ValidationInfo):
        if value and info.data.get("add_generation_prompt"):
            raise unsupported("Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True.")  # vLLM's words
        return value


# OpenAI chat fields that this server refuses rather than ignores, and why.
REFUSED_CHAT_FIELDS = {
    "tools": "Tool calling is not supported by this server.",
    "functions": "Tool calling is not supported by this server.",
    "tool_choice": "tool_choice needs tools, and tool calling is not supported.",
    "function_call": "function_call needs functions, and tool calling is not supported.",
    "audio": "Audio output is not supported.",
    "prediction": "Predicted outputs are not supported.",
    "web_search_options": "Web search is not supported.",
    "reasoning_effort": "reasoning_effort is for reasoning models; this one is not.",
    "use_beam_search": "Beam search runs on /v1/completions only here.",
}


class ChatCompletionRequest(SamplingFields, ChatTemplateFlags):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None  # 0..MAX_LOGPROBS, or -1: the whole vocabulary (vLLM's)
    LOGPROBS_PARAM = "top_logprobs"
    # OpenAI fields this server refuses rather than ignores:
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    functions: list | None = None
    function_call: Union[str, dict, None] = None
    audio: dict | None = None
    modalities: list[str] | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None
    echo: bool = False  # vLLM's: the last (assistant's) message before the answer

    @field_validator(*REFUSED_CHAT_FIELDS)
    @classmethod
    def _refused(cls, value, info: ValidationInfo):
        if value not in (None, [], {}, "none", False):  # "none": no tool call, as without tools
            raise unsupported(REFUSED_CHAT_FIELDS[info.field_name])
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value):
        if value is not None and value != ["text"]:
            raise unsupported('Only modalities ["text"] is supported.')
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if value is not None and value < -1:
            raise unsupported("`top_logprobs` must be a positive value or -1.")
        if value and not info.data.get("logprobs"):  # -1 or > 0
            raise unsupported("when using `top_logprobs`, `logprobs` must be set to true.")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]

    def logprobs_count(self) -> int | None:
        """Top logprobs per token, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_count(self) -> int | None:
        """vLLM's rule: `echo` without prompt_logprobs asks for top_logprobs of them."""
        if self.prompt_logprobs is None and self.echo:
            return self.top_logprobs or 0
        return self.prompt_logprobs


# ch06: `prompt` is a string, several strings, token ids, or several lists of ids.
PromptInput = Union[Text, list[Text], list[Annotated[int, Field(ge=0)]],
                    list[list[Annotated[int, Field(ge=0)]]]]


REFUSED_COMPLETION_FIELDS = {"echo": "echo is not supported.",  # refused, not ignored
                             "suffix": "suffix (insertion) is not supported."}


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    logprobs: int | None = None  # 0..MAX_LOGPROBS, or -1: the whole vocabulary (vLLM's)
    LOGPROBS_PARAM = "logprobs"
    best_of: int | None = Field(default=None, ge=1)
    echo: bool = False
    suffix: Text | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs_or_minus_one(cls, value):
        if value is not None and value < -1:
            raise unsupported("`logprobs` must be a positive value or -1.")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info: ValidationInfo):
        if value is not None and value != info.data.get("n", 1):
            raise unsupported("best_of is not supported (only best_of = n).")
        return value

    @field_validator(*REFUSED_COMPLETION_FIELDS)
    @classmethod
    def _refused(cls, value, info: ValidationInfo):
        if value:  # false, None or "": not asked for
            raise unsupported(REFUSED_COMPLETION_FIELDS[info.field_name])
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs
