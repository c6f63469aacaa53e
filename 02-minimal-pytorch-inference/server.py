"""Chapter 02: the naive server of the source material, top to bottom.

FastAPI, a plain `def` endpoint (FastAPI runs one thread per request) and
`model.generate`, with a KV cache reserved for the worst case: a static
cache of `max_model_len` tokens per request, booked on the card. Two
concurrent requests on a card that holds one -> CUDA out of memory.

From common/ it takes the loader, the card, and what every chapter shares:
OpenAI's response shapes and error envelope, and the command line.

    python 02-minimal-pytorch-inference/server.py --device-memory-gb 1.1 --dtype float32
"""
import sys
import time
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import torch  # noqa: E402
from fastapi import Request  # noqa: E402
from pydantic import ConfigDict, Field, model_validator  # noqa: E402
from transformers import StaticCache, StoppingCriteria, StoppingCriteriaList  # noqa: E402

from common.autoregressive import eos_token_ids  # noqa: E402
from common.entrypoints.chapters import refuse_later_fields  # noqa: E402
from common.entrypoints.cli_args import parse_server_args, server_parser  # noqa: E402
from common.entrypoints.launcher import log, serve  # noqa: E402
from common.entrypoints.middleware import APIError, new_app  # noqa: E402
from common.entrypoints.protocol import INT64_MAX, INT64_MIN, StrictModel, Text  # noqa: E402
from common.entrypoints.responses import (ChatChoice, ChatCompletionResponse,  # noqa: E402
                                          ModelCard, ModelList, ResponseMessage, Usage, new_id)
from common.entrypoints.request_checks import check_context, check_model_name  # noqa: E402
from common.loader import apply_chat_template, load_model  # noqa: E402
from common.memory import (Card, activation_bytes_estimate, format_bytes,  # noqa: E402
                           static_cache_bytes)
from common.sampling_params import SAMPLING_EPS  # noqa: E402

# ch02: the flags of later chapters (--quantization, ...) are refused, not ignored.
args = parse_server_args(server_parser("Chapter 02: the naive model.generate server", "02"), "02")
MODEL_NAME = args.served_model_name or args.model

lm = load_model(args.model, args.dtype, args.device, args.load_format, args.seed)
model, tokenizer = lm.model, lm.tokenizer
max_model_len = args.max_model_len or lm.max_model_len
eos = list(eos_token_ids(model, tokenizer))

card = Card(lm.device, args.device_memory_gb, args.gpu_memory_utilization)
room_for_requests = card.budget_bytes - card.charge_weights(model)  # what any request may get
kv_per_request = static_cache_bytes(model.config, lm.dtype, max_model_len)
print(f"[ch02] {card.describe()}; each request reserves {format_bytes(kv_per_request)} "
      f"of KV cache ({max_model_len} tokens)", flush=True)

app = new_app("Chapter 02: naive inference server")  # errors in OpenAI's envelope


class Message(StrictModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text


class ChatCompletionRequest(StrictModel):
    # Only what this server implements: any other field (`stop`, `stream`,
    # `n`...) is a 400 that names it, never silently ignored.
    model_config = ConfigDict(extra="forbid", strict=True)
    model: Text | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    ignore_eos: bool = False  # vLLM's extra: the load test writes a fixed number of tokens

    @model_validator(mode="before")
    @classmethod
    def _later_chapters_fields(cls, body):
        """`stream`, `stop`, ...: a 400 naming the chapter that adds them."""
        if isinstance(body, dict):
            refuse_later_fields({k: v for k, v in body.items() if k not in cls.model_fields}, "02")
        return body


class ClientGone(StoppingCriteria):
    """Ends `model.generate` once the client has hung up (asked of the event
    loop at most every 0.25 s), so an abandoned request frees its reservation."""

    def __init__(self, request: Request):
        self.request, self.gone, self.checked_at = request, False, time.monotonic()

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if not self.gone and time.monotonic() - self.checked_at > 0.25:
            self.checked_at = time.monotonic()
            self.gone = anyio.from_thread.run(self.request.is_disconnected)
            if self.gone:
                log.info("[ch02] client disconnected: generation stopped")
        return torch.full((input_ids.shape[0],), self.gone, dtype=torch.bool)


@app.post("/v1/chat/completions")
def chat_completions(req: ChatCompletionRequest, request: Request) -> ChatCompletionResponse:
    # Problem 3: no queue. A plain `def` = one worker thread per request, all
    # of them racing for the same card.
    check_model_name(req.model, MODEL_NAME)  # 404 for another model, as OpenAI answers
    prompt_ids = apply_chat_template(tokenizer, [m.model_dump() for m in req.messages])
    max_tokens = req.max_tokens or max(1, min(256, max_model_len - len(prompt_ids)))
    check_context(len(prompt_ids), max_tokens, max_model_len, "messages")
    # Problem 4: reserve the worst case (max_model_len), whatever the prompt.
    activations = activation_bytes_estimate(model.config, len(prompt_ids), lm.dtype)
    if kv_per_request + activations > room_for_requests:  # not even on an idle card
        raise APIError(400, f"This prompt ({len(prompt_ids)} tokens) needs "
                       f"{format_bytes(kv_per_request + activations)} for its static KV cache "
                       f"and activations; the card can never give one request more than "
                       f"{format_bytes(room_for_requests)}.", param="messages")
    with card.reserve(kv_per_request + activations,
                      f"a static KV cache of {max_model_len} tokens + activations"):
        log.info("[ch02] reserved %s for a request: %s", format_bytes(kv_per_request),
                 card.describe())
        # Problem 1: a fresh cache per request, no reuse of shared prefixes.
        cache = StaticCache(config=model.config, max_cache_len=max_model_len)
        input_ids = torch.tensor([prompt_ids], device=lm.device)
        if req.seed is not None:
            torch.manual_seed(req.seed)  # the global generator: not reproducible under load
        sampled = req.temperature >= SAMPLING_EPS  # below it: greedy, as vLLM (1e-300: NaN)
        # Problem 2: one request per generate call, no batching.
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), past_key_values=cache,
            max_new_tokens=max_tokens, min_new_tokens=max_tokens if req.ignore_eos else 0,
            do_sample=sampled, temperature=req.temperature if sampled else None,
            top_p=req.top_p, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
            stopping_criteria=StoppingCriteriaList([ClientGone(request)]))
    new_ids = output[0, len(prompt_ids):].tolist()
    log.info("[ch02] request done: %d prompt + %d new tokens used %.2f%% of the %d "
             "reserved slots", len(prompt_ids), len(new_ids),
             100 * (len(prompt_ids) + len(new_ids)) / max_model_len, max_model_len)
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    reason = "stop" if new_ids and new_ids[-1] in eos else "length"
    return ChatCompletionResponse(
        id=new_id("chatcmpl"), created=int(time.time()), model=MODEL_NAME,
        choices=[ChatChoice(index=0, message=ResponseMessage(content=text),
                            finish_reason=reason)],
        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(new_ids),
                    total_tokens=len(prompt_ids) + len(new_ids)))


@app.get("/v1/models")
def list_models() -> ModelList:
    return ModelList(data=[ModelCard(id=MODEL_NAME, created=int(time.time()),
                                     max_model_len=max_model_len)])


@app.get("/health")
def health() -> dict:
    return {"status": "ok"}


if __name__ == "__main__":
    sys.exit(serve(app, args))
