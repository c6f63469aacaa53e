"""Peers: transformers' own ways to serve the bench's load, in-process (bench).

    python -m bench.peers.hf_peers --clients 32 --max-tokens 64
    python -m bench.peers.hf_peers --clients 4 --max-tokens 8 tiny-llama --load-format dummy

`make bench PEERS=1` puts three baselines beside the chapters, on the same
prompts (the load test's `prompt_messages`, through the model's chat
template) and the same output lengths (EOS ignored, as the load test asks
with `ignore_eos`), all greedy:

- `hf-generate`: `model.generate`, one request after the other;
- `hf-static-batch`: padded static batching, `clients` prompts at a time
  (left padding and an attention mask), the next batch waits for the
  slowest sequence of the previous one;
- `hf-generate-batch`: transformers' continuous batching,
  `model.generate_batch` (paged KV cache, blocks of 16 tokens as in our
  engine, at most `clients` sequences and 512 tokens per step, like our
  chapter 05 defaults; prefix sharing off, as in our default servers).

Every request arrives at t=0 (an offline batch), so the latency of request
i is the time from t=0 to its last token, queueing included, which is what
a closed-loop client with one request sees. The figures come out of
`bench.loadtest.summarize`, with the chapters' definitions. TTFT, TPOT and
ITL exist only for `hf-generate-batch` (it timestamps each token).

Left out: HTTP (the peers pay no server overhead), the card (nothing is
booked against `--device-memory-gb`), sampling (greedy only), and CUDA
graphs or `torch.compile` settings beyond the library's defaults.
"""
from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from bench.loadtest import RequestResult, format_table, prompt_messages, summarize
from common.loader import LoadedModel, apply_chat_template, load_model

DEADLINE_ERROR = "load test deadline reached"  # the load test's own words
PAGE_SIZE = 16  # tokens per KV block, our engine's default --block-size
MAX_BATCH_TOKENS = 512  # our engine's default --max-num-batched-tokens


def chat_prompts(loaded: LoadedModel, count: int) -> list[list[int]]:
    """The load test's prompts 0..count-1, as token ids."""
    return [apply_chat_template(loaded.tokenizer, prompt_messages(i)) for i in range(count)]


def _greedy_config(loaded: LoadedModel, max_tokens: int) -> GenerationConfig:
    """Greedy, exactly `max_tokens` new tokens: EOS is masked until then, as
    chapter 02 does for `ignore_eos`."""
    return GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                            do_sample=False, pad_token_id=loaded.tokenizer.pad_token_id)


@dataclass
class PeerLoad:
    """The load, as a peer sees it: every prompt at once."""
    prompts: list[list[int]]
    max_tokens: int
    clients: int  # the batch size of static batching, the most running in generate_batch
    deadline: float = 1800.0  # s: what is not started by then fails
    max_batch_tokens: int = MAX_BATCH_TOKENS  # generate_batch's tokens per step


@torch.no_grad()
def _generate(loaded: LoadedModel, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    """One `model.generate` call on a left-padded batch; returns the new tokens."""
    width = max(len(p) for p in batch)
    pad = loaded.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=loaded.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                        device=loaded.device)  # (batch, width): 0 on the padding
    out = loaded.model.generate(ids, attention_mask=mask,
                                generation_config=_greedy_config(loaded, max_tokens))
    return out[:, width:].tolist()  # (batch, max_tokens)


def run_static_batches(loaded: LoadedModel, load: PeerLoad, batch_size: int,
                       progress=None) -> list[RequestResult]:
    """`batch_size` prompts per `model.generate` call, one call after the other.
    With batch_size=1 this is plain `model.generate`, one request at a time."""
    start = time.perf_counter()
    results: list[RequestResult] = []
    for first in range(0, len(load.prompts), batch_size):
        batch = load.prompts[first:first + batch_size]
        if time.perf_counter() - start > load.deadline:
            results += [RequestResult(False, DEADLINE_ERROR) for _ in batch]
            continue
        new_tokens = _generate(loaded, batch, load.max_tokens)
        done = time.perf_counter() - start  # every request of the batch ends here
        results += [RequestResult(True, e2e=done, completion_tokens=len(row))
                    for row in new_tokens]
        if progress is not None:
            progress.update(len(batch))
    return results


def run_generate_one_by_one(loaded: LoadedModel, load: PeerLoad,
                            progress=None) -> list[RequestResult]:
    return run_static_batches(loaded, load, 1, progress)


def run_static_batching(loaded: LoadedModel, load: PeerLoad,
                        progress=None) -> list[RequestResult]:
    return run_static_batches(loaded, load, load.clients, progress)


def _result_from_output(output, t0: float) -> RequestResult:
    """A generate_batch GenerationOutput -> the load test's RequestResult."""
    if output.error is not None:
        return RequestResult(False, f"generate_batch: {output.error}")
    stamps = output.timestamps or []
    return RequestResult(True, e2e=output.lifespan[1] - t0,
                         ttft=stamps[0] - t0 if stamps else None,
                         completion_tokens=len(output.generated_tokens),
                         itls=[b - a for a, b in itertools.pairwise(stamps)])


@torch.no_grad()
def run_generate_batch(loaded: LoadedModel, load: PeerLoad,
                       progress=None) -> list[RequestResult]:
    """transformers' continuous batching. The KV cache is sized for every
    request at once (it has no card to respect), in blocks of PAGE_SIZE.
    One call: the deadline cannot cut it short."""
    # Imported here: the other peers run on transformers releases without it
    # (the GPU check's machine brings its own transformers).
    from transformers import ContinuousBatchingConfig
    longest = max(map(len, load.prompts)) + load.max_tokens
    cb_config = ContinuousBatchingConfig(
        page_size=PAGE_SIZE, num_blocks=len(load.prompts) * -(-longest // PAGE_SIZE) + 1,
        max_batch_tokens=load.max_batch_tokens, max_requests_per_batch=load.clients,
        allow_block_sharing=False)
    # eos_token_id=-1: generate_batch's way to say "no EOS", so ignore_eos.
    generation = GenerationConfig(max_new_tokens=load.max_tokens, do_sample=False,
                                  eos_token_id=-1)
    outputs = loaded.model.generate_batch(load.prompts, generation_config=generation,
                                          continuous_batching_config=cb_config,
                                          record_timestamps=True)
    if progress is not None:
        progress.update(len(load.prompts))
    ordered = list(outputs.values())  # in the order of the prompts
    t0 = min((o.created_time for o in ordered), default=0.0)  # all added at once
    results = [_result_from_output(o, t0) for o in ordered]
    results += [RequestResult(False, "generate_batch returned no result")
                for _ in range(len(load.prompts) - len(ordered))]
    return results


PeerFn = Callable[[LoadedModel, PeerLoad, object], list[RequestResult]]
PEERS: dict[str, PeerFn] = {
    "hf-generate": run_generate_one_by_one,
    "hf-static-batch": run_static_batching,
    "hf-generate-batch": run_generate_batch,
}
PEER_DESCRIPTIONS = {
    "hf-generate": "transformers model.generate, one request at a time",
    "hf-static-batch": "transformers model.generate, padded static batches of `clients`",
    "hf-generate-batch": "transformers generate_batch (continuous batching)",
}


def run_peer(name: str, loaded: LoadedModel, clients: int, requests_per_client: int,
             max_tokens: int, deadline: float = 1800.0, progress=None,
             max_batch_tokens: int = MAX_BATCH_TOKENS) -> dict:
    """Run one peer on the load test's load; returns the load test's summary."""
    load = PeerLoad(chat_prompts(loaded, clients * requests_per_client), max_tokens,
                    clients, deadline, max_batch_tokens)
    start = time.perf_counter()
    results = PEERS[name](loaded, load, progress)
    wall = time.perf_counter() - start
    if name == "hf-generate-batch":  # its own clock: from the first arrival to the last token
        wall = max([r.e2e for r in results if r.ok], default=wall)
    summary = summarize(results, wall)
    summary["server_stats"] = None
    summary["load"] = {"clients": clients, "requests_per_client": requests_per_client,
                       "max_tokens": max_tokens, "stream": False}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--requests", type=int, default=1, help="per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--deadline", type=float, default=1800.0, help="per peer, s")
    parser.add_argument("--max-batch-tokens", type=int, default=MAX_BATCH_TOKENS,
                        help="generate_batch's tokens per step")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="comma-separated, among " + ", ".join(PEERS))
    args = parser.parse_args(argv)
    loaded = load_model(args.model, args.dtype, args.device, args.load_format)
    print(f"{args.model} on {loaded.device} ({loaded.dtype}); load: {args.clients} clients "
          f"x {args.requests} requests, {args.max_tokens} tokens each", flush=True)
    for name in args.peers.split(","):
        with tqdm(total=args.clients * args.requests, desc=name, unit="req") as bar:
            summary = run_peer(name, loaded, args.clients, args.requests, args.max_tokens,
                               args.deadline, bar, max_batch_tokens=args.max_batch_tokens)
        print(f"\n{name}: {PEER_DESCRIPTIONS[name]}\n{format_table(summary)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
