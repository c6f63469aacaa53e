"""Speculative decoding, measured (ch07): chapter 06 with and without n-gram drafts.

    python -m bench.experiments.spec_decode                  # float32, K=4, 1 and 32 clients
    python -m bench.experiments.spec_decode --dtype bfloat16 --clients 1 8 32
    python -m bench.experiments.spec_decode --schedule '[[1, 8, 4], [9, 1024, 0]]' --tag schedule

One run, one machine: chapter 06 is started twice, without and then with
`--speculative-config` (method ngram, `--k` drafts, lookup 4..2, and
`--schedule` as its `num_speculative_tokens_per_batch_size`), and each
server gets the same loads, greedy, `--max-tokens` at most (answers end at
EOS, as a user's would):

- "repetitive": what prompt lookup is for: rewrite a passage with one
  word changed, copy a list, edit code in place, extract sentences word
  for word (the answer repeats its prompt);
- "chat": the load test's free questions (little to copy).

At 1 client (`--sequential` requests one after the other) and at each
`--clients` count (one request per client, all at once), it records the
output tokens/s (completion tokens / wall time), the acceptance rate of
the drafts (from the server's /stats counters, before and after the
load), the mean tokens per verification step, and whether each answer's
text is the same with and without speculation (greedy: it must be).

Results: bench/results/DATE-HOST-spec-decode[-TAG].{json,md}, with the ratio
of tokens/s with speculation to without, measured in the same run.

Left out: sampled (temperature > 0) loads, other proposers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from bench.record import bf16_words, machine, write_results
from bench.loadtest import ROOT, ChapterServer, prompt_messages
from common.net import free_port

PASSAGE = ("The river runs past the old mill and under the stone bridge. In spring the river "
           "floods the meadow, and the children watch the water from the bridge. The miller "
           "says the river was wider when his grandfather built the mill. Every autumn the "
           "river brings leaves from the hills, and the mill wheel turns slower.")
CODE = ("def add_all(values):\n    total = 0\n    for value in values:\n"
        "        total += value\n    return total\n\n\ndef mean(values):\n"
        "    total = add_all(values)\n    return total / len(values)\n")
REPETITIVE = [
    f"Rewrite this paragraph word for word, but write 'stream' instead of 'river':\n\n{PASSAGE}",
    f"Copy this text exactly, then stop:\n\n{PASSAGE}",
    f"Rename the variable `total` to `result` in this Python code and print the whole "
    f"code again:\n\n```python\n{CODE}```",
    f"From the text below, copy every sentence that mentions the mill, word for word:"
    f"\n\n{PASSAGE}",
    "Repeat this list exactly, one item per line: apples, pears, plums, cherries, grapes, "
    "lemons, limes, figs, dates, melons, peaches, apricots.",
    f"Add a comment line above each function of this code and print the whole code:"
    f"\n\n```python\n{CODE}```",
]
WORKLOADS = {"repetitive": lambda i: [{"role": "user", "content": REPETITIVE[i % len(REPETITIVE)]}],
             "chat": prompt_messages}


def send(url: str, messages: list[dict], max_tokens: int) -> dict:
    response = requests.post(url + "/v1/chat/completions", timeout=900, json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    response.raise_for_status()
    answer = response.json()
    return {"text": answer["choices"][0]["message"]["content"],
            "tokens": answer["usage"]["completion_tokens"]}


def spec_counters(url: str) -> dict:
    """The server's draft counters (absent, so 0, without --speculative-config)."""
    stats = requests.get(url + "/stats", timeout=10).json()
    return {k: stats.get(k, 0) for k in ("spec_decode_num_drafts",
                                         "spec_decode_num_draft_tokens",
                                         "spec_decode_num_accepted_tokens")}


def run_load(url: str, workload: str, clients: int, requests_each: int, max_tokens: int) -> dict:
    """`clients` threads, each sending `requests_each` requests in turn."""
    before = spec_counters(url)

    def client(c: int) -> list[dict]:
        return [send(url, WORKLOADS[workload](c * requests_each + r), max_tokens)
                for r in range(requests_each)]

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        answers = [a for per_client in pool.map(client, range(clients)) for a in per_client]
    wall = time.perf_counter() - start
    after = spec_counters(url)
    delta = {k: after[k] - before[k] for k in after}
    tokens = sum(a["tokens"] for a in answers)
    drafts, checked = delta["spec_decode_num_drafts"], delta["spec_decode_num_draft_tokens"]
    accepted = delta["spec_decode_num_accepted_tokens"]
    return {"workload": workload, "clients": clients, "requests": len(answers),
            "completion_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "acceptance_rate": accepted / checked if checked else None,
            "tokens_per_verify_step": (drafts + accepted) / drafts if drafts else None,
            **delta, "texts": [a["text"] for a in answers]}


def measure(args, spec: dict | None, log_dir: Path) -> list[dict]:
    server_args = ["--dtype", args.dtype, "--device-memory-gb", str(args.card)]
    if spec is not None:
        server_args += ["--speculative-config", json.dumps(spec)]
    name = "spec" if spec else "plain"
    rows = []
    with ChapterServer("07", free_port(), server_args, log_dir / f"ch07-{name}.log") as server:
        for workload in WORKLOADS:
            send(server.url, WORKLOADS[workload](0), 8)  # warm up
            loads = [(1, args.sequential)] + [(c, 1) for c in args.clients]
            for clients, each in loads:
                row = run_load(server.url, workload, clients, each, args.max_tokens)
                row["speculation"] = name
                rows.append(row)
                print(f"{name:5} {workload:10} {clients:3} clients: {row['tok_s']:7.1f} tok/s",
                      flush=True)
    return rows


def markdown(rec: dict) -> str:
    m = rec["machine"]
    schedule = rec["spec"].get("num_speculative_tokens_per_batch_size")
    lines = [f"# Speculative decoding (n-gram, K={rec['spec']['num_speculative_tokens']}"
             + (f", by batch size {schedule}" if schedule else "")
             + "), chapter 06 with and without",
             "",
             f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores, {bf16_words(m)}), "
             f"{rec['dtype']}, `{rec['command']}`; greedy, at most {rec['max_tokens']} tokens "
             "per answer (ending at EOS); one server at a time.",
             "",
             "| workload | clients | requests | tok/s without | tok/s with | ratio | "
             "acceptance | tokens per verify step | same text |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rec["rows"]:
        acc = row["acceptance_rate"]
        per_step = row["tokens_per_verify_step"]
        lines.append(
            f"| {row['workload']} | {row['clients']} | {row['requests']} | "
            f"{row['tok_s_without']:.1f} | {row['tok_s_with']:.1f} | "
            f"**{row['ratio']:.2f}x** | {'-' if acc is None else f'{acc:.1%}'} | "
            f"{'-' if per_step is None else f'{per_step:.2f}'} | "
            f"{row['same_text']}/{row['requests']} |")
    lines += ["", "tokens per verify step: (drafts checked + accepted) / verification "
              "steps. Were each draft accepted independently with probability a, K drafts "
              "would give (1 - a^(K+1)) / (1 - a) tokens per step (2.8 for a = 0.7, K = 4); "
              "n-gram drafts are accepted in runs (a copied passage is copied on), so more.",
              ""]
    return "\n".join(lines)


def pair(plain: list[dict], spec: list[dict]) -> list[dict]:
    rows = []
    for without, with_ in zip(plain, spec):
        same = sum(a == b for a, b in zip(without["texts"], with_["texts"]))
        rows.append({"workload": with_["workload"], "clients": with_["clients"],
                     "requests": with_["requests"], "tok_s_without": without["tok_s"],
                     "tok_s_with": with_["tok_s"], "ratio": with_["tok_s"] / without["tok_s"],
                     "acceptance_rate": with_["acceptance_rate"],
                     "tokens_per_verify_step": with_["tokens_per_verify_step"],
                     "same_text": same, "without": without, "with": with_})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--clients", type=int, nargs="+", default=[32])
    parser.add_argument("--sequential", type=int, default=6,
                        help="requests one after the other at 1 client")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--schedule", type=json.loads, default=None,
                        help="num_speculative_tokens_per_batch_size, as JSON: [[first, last, k], ...]")
    parser.add_argument("--tag", default="", help="a suffix for the results file")
    parser.add_argument("--card", type=float, default=2.0)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    if args.schedule is not None:
        spec["num_speculative_tokens_per_batch_size"] = args.schedule
    log_dir = Path("/tmp/spec-decode-logs")
    log_dir.mkdir(exist_ok=True)
    plain = measure(args, None, log_dir)
    with_spec = measure(args, spec, log_dir)
    command = "python -m bench.experiments.spec_decode" + (f" {' '.join(argv)}" if argv else "")
    rec = {"date": str(datetime.date.today()), "machine": machine(), "dtype": args.dtype,
           "spec": spec, "max_tokens": args.max_tokens, "command": command,
           "rows": pair(plain, with_spec)}
    write_results(args.out_dir, "spec-decode" + (f"-{args.tag}" if args.tag else ""), rec,
                  markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
