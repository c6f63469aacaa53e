"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them (ch06).

`/tokenize` takes a prompt, or chat messages (through the chat template,
exactly what a chat request would feed the model), and answers the token
ids, their count and `max_model_len`; with `return_token_strs`, each token
as the tokenizer writes it. `/detokenize` turns token ids back into text.
Both are plain `def` routes: FastAPI runs them in a worker thread.

Left out: tools and multimodal messages.
"""
from __future__ import annotations

from pydantic import Field

from common.entrypoints.middleware import APIError
from common.entrypoints.protocol import ChatMessage, ChatTemplateFlags, StrictModel, Text
from common.entrypoints.serving_engine import OpenAIServing
from common.loader import apply_chat_template


class TokenizeRequest(ChatTemplateFlags):
    """vLLM's `/tokenize`: a prompt, or chat messages through the template."""
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False  # vLLM's: also each token as the tokenizer writes it


class DetokenizeRequest(StrictModel):
    model: Text | None = None
    tokens: list[int] = Field(max_length=1 << 16)


class OpenAIServingTokenization(OpenAIServing):
    """vLLM's tokenizer endpoints."""

    def tokenize(self, req: TokenizeRequest) -> dict:
        self.lora_request(req.model)  # a 404 for a model it does not serve
        if req.messages:
            tokens = apply_chat_template(self.tokenizer, [m.as_dict() for m in req.messages],
                                         req.add_generation_prompt, req.continue_final_message)
        elif req.prompt is not None:
            tokens = self.encode(req.prompt, req.add_special_tokens)
        else:
            raise APIError(400, "Give either `prompt` or `messages`.", param="prompt")
        answer = {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}
        if req.return_token_strs:
            answer["token_strs"] = self.tokenizer.convert_ids_to_tokens(tokens)
        return answer

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.lora_request(req.model)  # a 404 for a model it does not serve
        return {"prompt": self.tokenizer.decode(self.check_token_ids(req.tokens, "tokens"))}
