"""The sample outputs the chapters quote, captured from real runs.

    python -m pictures.make.samples            # all of them (~5 min on 2 cores)
    python -m pictures.make.samples --only ch05-chat-and-stats ch05-traces

Each sample is what a learner sees when running the command it names: a
server's answers (`curl` of one chat request, then `/stats`), its log lines
under the load test, chapter 02's out-of-memory error, chapter 05's offline
batch, and step-by-step traces of the engine (chunked prefill, the cap on
a long prefill, preemption) written from the scheduler's own batches.
Results: bench/results/DATE-HOST-samples.{json,md}; the pages quote the
markdown line for line (tests/test_figures.py checks each quoted line).

Left out: ids and timestamps are what they were in that run; a trace is
the engine in-process (no HTTP), on the same model and settings as named.
"""
from __future__ import annotations

import argparse
import datetime
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from bench.loadtest import CHAPTERS, ROOT, ChapterServer, prompt_messages, run_load
from bench.record import bf16_words, machine, write_results
from common.net import free_port

RESULTS_DIR = ROOT / "bench" / "results"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"messages": FRANCE, "max_tokens": 40, "temperature": 0}  # the chapters' curl
STORY = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 40}


# ------------------------------------------------------------ from servers
def _server(chapter: str, *server_args: str) -> ChapterServer:
    port = free_port()
    return ChapterServer(chapter, port, ["--dtype", "float32", *server_args],
                         Path(f"/tmp/samples-ch{chapter}-{port}.log"))


def chat_and_stats(chapter: str) -> dict:
    """One greedy chat request on the default card, then /stats."""
    with _server(chapter) as server:
        answer = requests.post(server.url + "/v1/chat/completions", json=CHAT, timeout=300)
        stats = requests.get(server.url + "/stats", timeout=30)
    return {"command": f"make serve CH={chapter}; curl the chat request; curl /stats",
            "text": answer.text.strip() + "\n" + stats.text.strip()}


# Chapters 06 and 07's READMEs: the requests they show with curl, as they write them.
CITY_SCHEMA = {"type": "object",
               "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                              "population": {"type": "integer", "minimum": 0,
                                             "maximum": 100000000}},
               "required": ["name", "country", "population"]}
CH06_REQUESTS = [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 12, "temperature": 0,
                              "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "The three primary colors are", "max_tokens": 16,
                         "temperature": 0}),
]
CH07_REQUESTS = [  # structured outputs: chapter 07's
    ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Describe Paris as JSON."}],
        "max_tokens": 100, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "city", "schema": CITY_SCHEMA}}}),
]


def answers(chapter: str, chapter_requests: list[tuple[str, dict]], what: str) -> dict:
    """The answers of a chapter's README, each request as it shows it."""
    with _server(chapter) as server:
        texts = [requests.post(server.url + path, json=body, timeout=300).text.strip()
                 for path, body in chapter_requests]
    return {"command": f"python {CHAPTERS[chapter]}/server.py --dtype float32; the README's "
                       f"curl requests ({what})",
            "text": "\n\n".join(texts)}


def log_lines(chapter: str, clients: int, *server_args: str) -> dict:
    """The engine's periodic log lines under the load test, on the demo
    card, then what /stats says after it."""
    with _server(chapter, "--device-memory-gb", "1.1", *server_args) as server:
        run_load(server.url, clients, 1, 64)
        time.sleep(1)  # the idle line
        stats = requests.get(server.url + "/stats", timeout=30)
        log = server.log_path.read_text(errors="replace")
    word = "Avg prompt throughput"
    lines = [line[line.index(word):] for line in log.splitlines() if word in line]
    flags = "".join(f" {a}" for a in server_args)
    return {"command": f"make loadtest CH={chapter} CLIENTS={clients} MAX_TOKENS=64"
                       + (f" (server{flags})" if flags else ""),
            "text": "\n".join(lines + [f"/stats after the load: {stats.text.strip()}"])}


def two_at_once() -> dict:
    """Chapter 02 on the demo card, two requests at the same time."""
    with _server("02", "--device-memory-gb", "1.1") as server:
        def send(_):
            return requests.post(server.url + "/v1/chat/completions", json=STORY, timeout=300)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(send, range(2)))
        log = server.log_path.read_text(errors="replace")
    done = [line[line.index("[ch02]"):] for line in log.splitlines() if "[ch02] request" in line]
    return {"command": "make serve CH=02 CARD=1.1; two curl requests at once",
            "text": "\n".join([f"HTTP {a.status_code} {a.text.strip()}" for a in answers]
                              + done)}


def loadtest_lines(chapter: str, clients: int, max_tokens: int, *server_args: str) -> dict:
    """The load test's summary line and first error."""
    with _server(chapter, "--device-memory-gb", "1.1", *server_args) as server:
        summary = run_load(server.url, clients, 1, max_tokens)
    errors = summary["first_errors"]
    text = f"{summary['completed']} completed, {summary['failed']} failed"
    if errors:
        text += f"\nfirst error: {errors[0]}"
    return {"command": (f"python -m bench.loadtest --chapter {chapter} --clients {clients} "
                        f"--max-tokens {max_tokens} --device-memory-gb 1.1 --dtype float32 "
                        + " ".join(server_args)).strip(),
            "text": text}


def offline() -> dict:
    script = "05-continuous-batching/offline.py"
    out = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return {"command": f"python {script}", "text": out.stdout.strip().splitlines()[-1]}


# ------------------------------------------------------- from the engine
def _trace_line(batch, names: dict) -> str:
    """One step: who is in the batch, doing what, and the step's tokens."""
    parts = []
    for item in batch:
        seq = item.seq
        name = names[seq.request_id]
        if item.num_new_tokens == 1 and seq.num_computed_tokens == seq.num_tokens - 1 \
                and seq.num_output_tokens > 0:
            parts.append(f"{name}:decode 1")
        else:
            parts.append(f"{name}:prefill {item.num_new_tokens}"
                         + ("" if item.samples else " (chunk, no sample)"))
    tokens = sum(item.num_new_tokens for item in batch)
    return f"[{', '.join(parts)}] tokens={tokens}"


def _traced(engine, names: dict, steps: int | None = None, with_blocks: bool = False):
    """Step the engine, one trace line per step."""
    lines, step = [], 0
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        if batch:
            line = _trace_line(batch, names)
            if with_blocks:
                s = engine.scheduler
                line += (f" free_blocks={s.bm.num_free_blocks} waiting={len(s.waiting)}"
                         f" preemptions={s.num_preemptions}")
            lines.append(f"step {step + 1:2d}: {line}")
        return batch

    engine.scheduler.schedule = recording_schedule
    while engine.has_unfinished_requests() and (steps is None or step < steps):
        engine.step()
        step += 1
    engine.scheduler.schedule = schedule
    return lines


def traces() -> dict:
    """Chunked prefill (no cap, then the default cap) and preemption, on
    chapter 05's engine in-process, float32."""
    from common.config import EngineConfig
    from common.engine.parts import assemble_engine
    from common.loader import apply_chat_template, load_model
    from common.sampling_params import SamplingParams

    loaded = load_model("smollm2", "float32", "cpu", "auto", 0)
    prompts = [apply_chat_template(loaded.tokenizer, prompt_messages(i)) for i in range(3)]
    long_prompt = (prompts[1] * 6)[:170]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    out = {}
    for title, cap in (("chunked prefill, no cap", 0), ("chunked prefill, default cap", None)):
        engine = assemble_engine(EngineConfig(dtype="float32", max_num_batched_tokens=64,
                                        long_prefill_token_threshold=cap,
                                        device_memory_gb=2.0), loaded=loaded)
        engine.add_request("A", prompts[0], params)
        while not engine.sequences["A"].num_output_tokens:  # A's prefill, then A decodes
            engine.step()
        engine.add_request("B", long_prompt, params)
        out[title] = _traced(engine, {"A": "A", "B": "B"}, steps=8)
    engine = assemble_engine(EngineConfig(dtype="float32", device_memory_gb=2.0), loaded=loaded,
                       num_blocks=14)
    for name, prompt in zip("XYZ", prompts):
        engine.add_request(name, prompt, params)
    out["preemption, 3 requests of 64 tokens, 14 blocks"] = _traced(
        engine, {n: n for n in "XYZ"}, with_blocks=True)
    text = "\n\n".join(f"{title}:\n" + "\n".join(lines) for title, lines in out.items())
    return {"command": "python -m pictures.make.samples --only ch05-traces (the engine in-process, "
                       "max_num_batched_tokens 64 for chunked prefill)", "text": text}


SAMPLES = {
    "ch02-two-at-once": two_at_once,
    "ch02-max-model-len-2048": lambda: loadtest_lines("02", 6, 8, "--max-model-len", "2048"),
    "ch03-chat-and-stats": lambda: chat_and_stats("03"),
    "ch03-log-2x64": lambda: log_lines("03", 2),
    "ch04-chat-and-stats": lambda: chat_and_stats("04"),
    "ch04-log-16x64": lambda: log_lines("04", 16),
    "ch04-log-32x64": lambda: log_lines("04", 32),
    "ch04-prefix-caching-32x64": lambda: log_lines("04", 32, "--enable-prefix-caching"),
    "ch05-chat-and-stats": lambda: chat_and_stats("05"),
    "ch05-log-32x64": lambda: log_lines("05", 32),
    "ch05-offline": offline,
    "ch05-traces": traces,
    "ch06-answers": lambda: answers("06", CH06_REQUESTS, "chat, streamed chat, completion"),
    "ch07-json-schema": lambda: answers("07", CH07_REQUESTS, "JSON schema"),
}


def markdown(rec: dict) -> str:
    m = rec["machine"]
    lines = [f"# Sample outputs, {rec['date'][:10]}", "",
             f"Command: `{rec['command']}`. Written {rec['date']} on {m['cpu']} "
             f"({m['cores']} cores, {bf16_words(m)}), torch {m['torch']}, float32.", ""]
    for name, sample in rec["samples"].items():
        lines += [f"## {name}", "", f"`{sample['command']}` ({sample['date']})", "", "```",
                  sample["text"], "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(SAMPLES), default=list(SAMPLES))
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    when = datetime.datetime.now()
    # --only: the others stay as today's file has them (each sample is dated)
    today = args.out_dir / f"{when:%Y-%m-%d}-{socket.gethostname()}-samples.json"
    samples = json.loads(today.read_text())["samples"] if today.exists() else {}
    failed = []
    for name in args.only:
        print(f"[samples] {name}", flush=True)
        try:
            sample = SAMPLES[name]()
        except Exception as error:  # the others are still worth writing
            print(f"[samples] {name} failed: {error!r}", flush=True)
            failed.append(name)
            continue
        samples[name] = {**sample, "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}"}
        print(samples[name]["text"][:600], flush=True)
    rec = {"date": when.isoformat(timespec="seconds"),
           "command": "python -m pictures.make.samples", "machine": machine(),
           "samples": {name: samples[name] for name in SAMPLES if name in samples}}
    write_results(args.out_dir, "samples", rec, markdown(rec))
    if failed:
        print(f"[samples] failed: {' '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
