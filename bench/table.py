"""The bench's results table: one markdown row per system and load.

`render_markdown` writes what `make bench` prints and keeps beside its
JSON (`bench/results/<date>-<host>[-preset][-label].md`): a header (the
machine, its bf16 support, the versions, the command, the model and the
card), the table (`markdown_table`, the columns of `TABLE_COLUMNS`), then
one line per system that needs words (`notes`: its note, its first
error). make figures renders every bench results file with it again and
checks that its .md is what its JSON gives; the pages' generated tables
take some of its columns.

Left out: measuring (bench/measure.py) and the figure (bench/plot.py).
"""
from __future__ import annotations

from bench.loadtest import CHAPTERS
from bench.record import bf16_words
from common.memory import MiB


def _num(value, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return fmt.format(value if scale == 1.0 else value * scale)


def _pair(a, b, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    return "-" if a is None else f"{_num(a, fmt, scale)} / {_num(b, fmt, scale)}"


def card_label(row: dict) -> str:
    """A chapter's card ("1.1 GiB", "whole"); "-" for a system without one."""
    if row["system"] not in CHAPTERS.values():
        return "-"
    return "whole" if row["card_gb"] is None else f"{row['card_gb']:g} GiB"


def _done(row: dict) -> str:
    if row["status"] in ("skipped", "error"):
        return row["status"]
    text = f"{row['completed']} / {row['failed']}"
    return f"**{text}**" if row["failed"] else text


TABLE_COLUMNS = [
    ("system", lambda r: r["name"]),
    ("card", card_label),
    ("load", lambda r: f"{r['clients']}x{r['requests_per_client']}x{r['max_tokens']}"),
    ("done / failed", _done),
    ("output tok/s", lambda r: _num(r["output_tokens_per_s"], "{:.1f}")),
    ("x ch02", lambda r: _num(r["x_ch02"], "{:.1f}x")),
    ("x vLLM", lambda r: _num(r.get("x_vllm"), "{:.2f}x")),
    ("req/s", lambda r: _num(r["requests_per_s"])),
    ("TTFT p50 / p95 s", lambda r: _pair(r["ttft_p50_s"], r["ttft_p95_s"])),
    ("TPOT ms", lambda r: _num(r["tpot_mean_s"], "{:.0f}", 1000)),
    ("ITL p50 ms", lambda r: _num(r["itl_p50_s"], "{:.0f}", 1000)),
    ("e2e p50 / p95 s", lambda r: _pair(r["e2e_p50_s"], r["e2e_p95_s"], "{:.1f}")),
    ("KV peak reserved / used MiB", lambda r: _pair(
        r["peak_kv_reserved_bytes"], r["peak_kv_used_bytes"], "{:.0f}", 1 / MiB)),
    ("KV waste", lambda r: _num(r["kv_waste_perc"], "{:.1f} %")),
    ("peak running", lambda r: _num(r["peak_running"], "{}")),
    ("preemptions", lambda r: _num(r["preemptions"], "{}")),
]


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """The results table; `columns`: only those (by their titles)."""
    chosen = [(name, cell) for name, cell in TABLE_COLUMNS if columns is None or name in columns]
    lines = ["| " + " | ".join(name for name, _ in chosen) + " |",
             "|" + "---|" * len(chosen)]
    lines += ["| " + " | ".join(cell(row) for _, cell in chosen) + " |" for row in rows]
    return "\n".join(lines)


LADDER_COLUMNS = [
    ("row", lambda r: r["name"]),
    ("what it changes from the row above", lambda r: r["change"]),
    ("moves", lambda r: r["moves"]),
    ("output tok/s", lambda r: _num(r["output_tokens_per_s"], "{:.1f}")),
    ("x the row above", lambda r: _num(r["x_above"], "{:.2f}x")),
    ("KV room, tokens", lambda r: _num(r["kv_room_tokens"], "{:,}")),
    ("requests that fit", lambda r: _num(r.get("requests_that_fit"), "{}")),
    ("KV waste", lambda r: _num(r["kv_waste_perc"], "{:.1f} %")),
    ("peak running", lambda r: _num(r["peak_running"], "{}")),
    ("prefix-cache hits", lambda r: _num(r["prefix_cache_hit_rate"], "{:.0f} %", 100)),
    ("e2e p50 s", lambda r: _num(r["e2e_p50_s"], "{:.1f}")),
    ("x ch02", lambda r: _num(r["x_ch02"], "{:.1f}x")),
]


def ladder_table(rows: list[dict]) -> list[str]:
    """The chapter ladder (chapters 03-06, one change a row), and the end to
    end figure set against the seed's "up to 24 times" the naive server."""
    ladder = [row for row in rows if row.get("change")]
    if not ladder:
        return []
    lines = ["## The chapter ladder: one change a row", "",
             "| " + " | ".join(name for name, _ in LADDER_COLUMNS) + " |",
             "|" + "---|" * len(LADDER_COLUMNS)]
    lines += ["| " + " | ".join(cell(row) for _, cell in LADDER_COLUMNS) + " |"
              for row in ladder]
    top = ladder[-1]
    if top["x_ch02"] is not None:
        lines += ["", f"End to end, row {top['name']} serves {top['x_ch02']:.1f}x chapter 02's "
                      f"output tokens/s on its roomy card, at {top['clients']} clients (the seed "
                      "article says \"up to 24 times the throughput of the naive method\", on "
                      "a GPU under its own load)."]
    return ["", *lines, ""]


def notes(rows: list[dict]) -> list[str]:
    """One line per system that needs words: its note, its first error."""
    out = []
    for name in dict.fromkeys(row["name"] for row in rows):
        mine = [row for row in rows if row["name"] == name]
        if mine[0]["note"]:
            out.append(f"- {name}: {mine[0]['note']}")
        failing = [row for row in mine if row["first_error"]]
        if failing:
            clients = ", ".join(str(row["clients"]) for row in failing)
            out.append(f"- {name}, first error ({clients} clients): "
                       f"`{failing[0]['first_error'][:240]}`")
    return out


def render_markdown(rec: dict) -> str:
    """A bench record (its JSON) -> its markdown: header, table, notes."""
    m, s = rec["machine"], rec["settings"]
    card = "whole device" if s["card_gb"] is None else f"{s['card_gb']:g} GiB"
    gpu = f", {m['gpu']}" if m["gpu"] else ", no GPU"
    header = [
        (f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores{gpu}; {bf16_words(m)}), "
         f"torch {m['torch']}, transformers {m['transformers']}"
         f"{', vLLM ' + m['vllm'] if m.get('vllm') else ''}; "
         f"{rec['duration_s'] / 60:.1f} min."),
        (f"Command: `{rec['command']}`. Model `{s['model']}` ({s['dtype']}, load format "
         f"{s['load_format']}), card {card}. Load = clients x requests per client x "
         "output tokens (EOS ignored, greedy)."),
        ("TTFT, TPOT and ITL need streaming (chapter 06, the servers that are not ours "
         "where they stream, and `hf-generate-batch`'s own timestamps); KV figures come "
         "from the servers' `/stats` (chapters 03-06)."),
    ]
    return "\n".join(header + ["", markdown_table(rec["rows"]), ""] + notes(rec["rows"])
                     + ladder_table(rec["rows"])) + "\n"
