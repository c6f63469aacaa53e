"""Chapter 02: the naive server of the source material.

FastAPI with a plain `def` endpoint (FastAPI runs one thread per request),
`model.generate`, and a KV cache reserved for the worst case: a static cache
of `max_model_len` tokens per request, allocated through the card. Two
concurrent requests on a card that holds one -> CUDA out of memory.

    python 02-minimal-pytorch-inference/server.py --device-memory-gb 1.1
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import StaticCache  # noqa: E402

from common.autoregressive import eos_token_ids  # noqa: E402
from common.loader import load_model  # noqa: E402
from common.memory import (Card, activation_bytes_estimate,  # noqa: E402
                           format_bytes, kv_bytes_per_token)
from common.entrypoints.chat_server import (Completion, build_chat_app, log,  # noqa: E402
                                            parse_server_args, serve, server_parser)
from common.entrypoints.protocol import ChatCompletionRequest  # noqa: E402


def main() -> int:
    args = parse_server_args(server_parser("Chapter 02: the naive model.generate server"))
    lm = load_model(args.model, args.dtype, args.device, args.load_format, args.seed)
    max_model_len = args.max_model_len or lm.max_model_len
    card = Card(lm.device, args.device_memory_gb, args.gpu_memory_utilization)
    card.charge_weights(lm.model)
    kv_per_request = kv_bytes_per_token(lm.model.config, lm.dtype) * max_model_len
    print(f"[ch02] {card.describe()}; each request reserves "
          f"{format_bytes(kv_per_request)} of KV cache ({max_model_len} tokens)", flush=True)
    eos = list(eos_token_ids(lm.model, lm.tokenizer))

    def generate(prompt_ids: list[int], req: ChatCompletionRequest, max_tokens: int,
                 seed: int | None) -> Completion:
        # Problem 4: reserve the worst case (max_model_len), whatever the prompt.
        activations = activation_bytes_estimate(lm.model.config, len(prompt_ids), lm.dtype)
        with card.reserve(kv_per_request + activations, "a static KV cache of "
                          f"{max_model_len} tokens + activations"):
            log.info("[ch02] reserved %s for a request: %s", format_bytes(kv_per_request),
                     card.describe())
            # Problem 1: a fresh cache per request, no reuse of shared prefixes.
            cache = StaticCache(config=lm.model.config, max_cache_len=max_model_len)
            input_ids = torch.tensor([prompt_ids], device=lm.device)
            if seed is not None:
                torch.manual_seed(seed)
            # Problem 2: one request per generate call, no batching.
            output = lm.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids),
                past_key_values=cache, max_new_tokens=max_tokens,
                min_new_tokens=max_tokens if req.ignore_eos else 0,
                do_sample=req.temperature > 0, temperature=req.temperature or None,
                top_p=req.top_p, eos_token_id=eos, pad_token_id=lm.tokenizer.pad_token_id)
        new_ids = output[0, len(prompt_ids):].tolist()
        log.info("[ch02] request done: %d prompt + %d new tokens used %.2f%% of "
                 "the %d reserved slots", len(prompt_ids), len(new_ids),
                 100 * (len(prompt_ids) + len(new_ids)) / max_model_len, max_model_len)
        reason = "stop" if new_ids and new_ids[-1] in eos else "length"
        return Completion(new_ids, reason)

    # Problem 3: no queue. A plain `def` endpoint = one thread per request,
    # all of them racing for the same card.
    app = build_chat_app(
        "Chapter 02: naive inference server", args.served_model_name or args.model,
        max_model_len, lm.tokenizer, generate, implemented={"top_p"})
    return serve(app, args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
