"""Chapter 06 against the real vLLM, request by request (bench; `make vllm-check`).

    python -m bench.peers.vllm_diff            # both servers, float32: a results file
    make vllm-check                      # the same comparisons as tests (tests/test_vllm.py)

Two comparisons, both greedy in float32, on servers started one after the
other or side by side:

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
  streams, logprobs, `n`, `stop`, `seed`, models, tokenize, detokenize,
  bad input) to both; `shape` reduces each answer to its fields and their
  JSON types, `compare_shapes` lists what differs. Fields that only one
  side sends, always as `null`, are listed apart (`null_only`): they carry
  nothing. Every other difference must be one of `WIRE_DIFFERENCES`, each
  with its reason; chapter 06's README lists them all (a test checks both).

Left out: sampled (non-greedy) outputs, which depend on each engine's
random generator; latency (`make bench PEERS=vllm` measures it); and the
vLLM-only endpoints (`/v1/responses`, `/pooling`, ...).
"""
from __future__ import annotations

import datetime
import json
import sys
import tempfile
from pathlib import Path

import requests

from bench.loadtest import PROMPTS, ROOT, SYSTEM_PROMPT, ChapterServer, free_port

MAX_TOKENS = 32
# vLLM's flags for the routes WIRE_REQUESTS reads (/load, /tokenizer_info): both servers take them
ROUTE_FLAGS = ["--enable-server-load-tracking", "--enable-tokenizer-info-endpoint"]
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


# ------------------------------------------------------------------- main
def render_markdown(rec: dict) -> str:
    """The results file's summary: agreement per pair, then the wire."""
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


def main() -> int:
    from bench.peers import vllm_peer
    from bench.bench import machine
    from common.loader import load_model
    problem = vllm_peer.missing()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="vllm-diff-"))
    loaded = load_model("smollm2", dtype="float32", device="cpu")
    with ChapterServer("08", free_port(), ["--dtype", "float32", *ROUTE_FLAGS],
                       logs / "ch08.log") as ours, \
            vllm_peer.VllmServer(free_port(), logs / "vllm.log", "float32",
                                 extra=ROUTE_FLAGS) as theirs:
        urls = {"ch06": ours.url, "vllm": theirs.url}
        runs = token_runs(urls, loaded)
        same_prompts = runs["prompts"]["ch06"] == runs["prompts"]["vllm"]
        agreement = token_agreement(runs["tokens"])
        found = divergences(urls, loaded, runs)
        wire = wire_differences(ours.url, theirs.url)
        metrics = {"ours": sorted(metric_names(ours.url)),
                   "vllm": sorted(metric_names(theirs.url))}
    rec = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": "python -m bench.peers.vllm_diff", "machine": machine(with_vllm=True),
           "same_prompt_ids": same_prompts, "agreement": agreement,
           "divergences": found, "wire": wire, "metrics": metrics,
           "undocumented": undocumented(wire)}
    stem = f"{rec['date'][:10]}-{rec['machine']['host']}-vllm-diff"
    out = ROOT / "bench" / "results" / f"{stem}.json"
    out.write_text(json.dumps(rec, indent=2) + "\n")
    out.with_suffix(".md").write_text(render_markdown(rec))
    print(json.dumps({"agreement": {p: (e["same"], e["of"]) for p, e in agreement.items()},
                      "undocumented": rec["undocumented"]}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
