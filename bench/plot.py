"""The bench's figure: `bench/chapters.png`, `bench/sweep.png` and their kin.

`draw` picks the figure for a bench record:

- `draw_chapters` (every preset but the sweeps): three panels of
  horizontal bars, one bar per system and load: output tokens/s,
  end-to-end latency (p50, with p95 behind it in grey) and KV cache waste.
  Chapters are blue, the servers that are not ours green, transformers'
  ways grey, and a row with failures red, with what failed written beside
  it;
- `draw_sweep` (the sweep presets): tokens/s and p95 latency against the
  number of clients, one line per system, a red cross where requests
  failed;
- `draw_ladder`, beside either (`chapters-ladder.png`) when the run has
  the chapter ladder: one bar per row, labelled with its one change.

Left out: error bars (one run per row), and the table (bench/table.py).
"""
from __future__ import annotations

from pathlib import Path

from bench.loadtest import CHAPTERS
from bench.presets import LLAMACPP, VLLM
from bench.table import card_label


def _pyplot():
    """matplotlib's pyplot, drawing to files only (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _bar_label(row: dict) -> str:
    label = f"{row['name']} @ {card_label(row)}" if card_label(row) != "-" else row["name"]
    return f"{label}, {row['clients']} cl. x {row['max_tokens']} tok"


def _mark_failures(ax, rows: list[dict], values: list[float]) -> None:
    """Write in red, beside each bar, what did not go well."""
    right = max(values, default=0) or 1.0
    for y, row in enumerate(rows):
        if row["status"] in ("skipped", "error"):
            ax.text(0, y, f" {row['status'].upper()}", va="center", color="grey"
                    if row["status"] == "skipped" else "red", fontweight="bold")
        elif row["failed"]:
            total = row["completed"] + row["failed"]
            ax.text(values[y] + right * 0.01, y, f" {row['failed']} of {total} FAILED", va="center",
                    color="red", fontweight="bold", fontsize=8)


def _over_http(row: dict) -> bool:
    """A server loaded over HTTP that is not ours: a URL row, vLLM, llama.cpp."""
    return row["system"] in ("url", VLLM, LLAMACPP)


def _no_waste_reason(row: dict) -> str:
    if row["status"] in ("skipped", "error"):
        return ""
    return "no /stats" if row["system"] in CHAPTERS.values() or _over_http(row) \
        else "n/a (no card)"


def draw_chapters(rows: list[dict], path: Path, title: str) -> None:
    """Three panels of horizontal bars: tokens/s, latency, KV waste."""
    plt = _pyplot()
    labels = [_bar_label(r) for r in rows]
    colors = ["tab:red" if r["failed"] or r["status"] == "error" else
              "tab:blue" if r["system"] in CHAPTERS.values() else
              "tab:green" if _over_http(r) else "tab:grey" for r in rows]
    ys = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 1.5 + 0.45 * len(rows)), sharey=True)
    tps = [r["output_tokens_per_s"] or 0.0 for r in rows]
    axes[0].barh(ys, tps, color=colors)
    axes[0].set_xlabel("output tokens/s (higher is better)")
    _mark_failures(axes[0], rows, tps)
    p50 = [r["e2e_p50_s"] or 0.0 for r in rows]
    p95 = [r["e2e_p95_s"] or 0.0 for r in rows]
    axes[1].barh(ys, p95, color="lightgrey")
    axes[1].barh(ys, p50, color=colors, height=0.5)
    axes[1].set_xlabel("end-to-end latency, s: p50 (bar), p95 (grey) (lower is better)")
    _mark_failures(axes[1], rows, p95)
    waste = [r["kv_waste_perc"] for r in rows]
    axes[2].barh(ys, [w or 0.0 for w in waste], color=colors)
    axes[2].set_xlim(0, 100)
    axes[2].set_xlabel("KV cache waste, % of reserved slots (lower is better)")
    for y, (w, row) in enumerate(zip(waste, rows)):
        if w is None:
            axes[2].text(1, y, _no_waste_reason(row), va="center", fontsize=8, color="grey")
        else:  # inside the bar when it is nearly full
            inside = w > 85
            axes[2].text(w - 1 if inside else w + 1, y, f"{w:.0f} %", va="center", fontsize=8,
                         ha="right" if inside else "left", color="white" if inside else "black")
    axes[0].set_yticks(list(ys), labels)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_sweep(rows: list[dict], path: Path, title: str) -> None:
    """Two panels against the number of clients: tokens/s and p95 latency."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for name in dict.fromkeys(r["name"] for r in rows):
        line = [r for r in rows if r["name"] == name and r["status"] not in ("skipped", "error")]
        if not line:
            continue
        label = f"{name} @ {card_label(line[0])}" if card_label(line[0]) != "-" else name
        xs = [r["clients"] for r in line]
        for ax, key in zip(axes, ["output_tokens_per_s", "e2e_p95_s"]):
            ax.plot(xs, [r[key] for r in line], marker="o", label=label)
            bad = [r for r in line if r["failed"]]
            ax.scatter([r["clients"] for r in bad], [r[key] or 0 for r in bad], marker="x",
                       s=120, color="red", zorder=3)
            for r in bad:
                ax.annotate(f"{r['failed']} of {r['failed'] + r['completed']} failed",
                            (r["clients"], r[key] or 0),
                            color="red", fontsize=8, xytext=(4, 6), textcoords="offset points")
    ticks = sorted({r["clients"] for r in rows})
    for ax, ylabel in zip(axes, ["output tokens/s", "end-to-end latency p95, s"]):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + "  (red x: requests failed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ladder_words(row: dict) -> str:
    """What a ladder row's bar says: its tok/s, its ratio to the row above,
    and the figure its change moves where that is not tok/s."""
    words = [f"{row['output_tokens_per_s']:.1f} tok/s"]
    if row["x_above"] is not None:
        words.append(f"{row['x_above']:.2f}x the row above")
    if "KV room" in row["moves"] and row.get("requests_that_fit") is not None:
        words.append(f"{row['requests_that_fit']} requests fit, KV waste "
                     f"{row['kv_waste_perc']:.1f} %")
    if "prefix" in row["moves"] and row["prefix_cache_hit_rate"] is not None:
        words.append(f"prefix-cache hits {row['prefix_cache_hit_rate']:.0%}")
    return "  " + ", ".join(words)


def draw_ladder(rows: list[dict], path: Path, title: str) -> None:
    """The chapter ladder: one bar per row (output tokens/s), labelled with
    the one thing the row changes from the row above."""
    ladder = [r for r in rows if r.get("change") and r["output_tokens_per_s"] is not None]
    if not ladder:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(13, 1.4 + 0.62 * len(ladder)))
    ys = range(len(ladder))
    tps = [r["output_tokens_per_s"] for r in ladder]
    ax.barh(ys, tps, color=["tab:red" if r["failed"] else "tab:blue" for r in ladder])
    for y, row in enumerate(ladder):
        ax.text(row["output_tokens_per_s"], y, _ladder_words(row), va="center", fontsize=8.5)
    ax.set_yticks(list(ys), [f"{r['name']}: {r['change']}" for r in ladder], fontsize=8.5)
    ax.invert_yaxis()
    ax.set_xlim(0, max(tps) * 2.0)
    ax.set_xlabel("output tokens/s (higher is better): each row changes one thing "
                  "from the row above")
    _mark_failures(ax, ladder, tps)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ladder_figure(path: Path) -> Path:
    """Where a run's ladder picture goes: beside its figure (chapters-ladder.png)."""
    return path.with_name(f"{path.stem}-ladder{path.suffix}")


def draw(rec: dict, path: Path) -> None:
    """A bench record's figure: the sweep's lines or the chapters' bars."""
    s, m = rec["settings"], rec["machine"]
    where = m["gpu"] or f"{m['cpu']}, {m['cores']} cores"
    title = f"{s['model']} ({s['dtype']}) on {where} - {rec['date'][:10]} - {rec['command']}"
    drawer = draw_sweep if s["preset"].startswith("sweep") else draw_chapters
    drawer(rec["rows"], path, title)
    draw_ladder(rec["rows"], ladder_figure(path), title)
