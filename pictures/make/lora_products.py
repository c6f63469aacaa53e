"""Chapter 10's picture: one base product for the whole batch, and a thin
side product per adapter (lora-products.png, `make pictures`).

    python -m pictures.make.pictures     # draws it with the others

One step's tokens belong to different adapters, or to none. The picture
shows one projection of the model (q_proj) as chapter 10's engine runs it
(common/lora/layers.py, common/lora/punica.py):

- the base product `x @ W^T`, once for every row of the batch: W is read
  once per step, whatever the adapters;
- for each adapter in the step, its rows alone through its A (in -> r)
  and its B (r -> out), scaled by alpha / r, added back at those rows:
  the grouped form (`add_lora_grouped`), N thin products for N adapters.

Drawn from pictures/data/lora-products.json (written by hand: the
embedded model's q_proj, the trained adapters' rank and alpha, the
step's tokens). The work per token printed at the bottom is arithmetic
on those shapes.

Left out: the gathered form (each row picks its own A and B: the same
sums, in another order), the fused q/k/v slices, the Triton kernels.
"""
from __future__ import annotations

BASE_COLOUR = "#d9d9d9"
WEIGHT_COLOUR = "#737373"
# The adapters in the order they first appear: the colours of the pool pictures.
ADAPTER_COLOURS = ["#ff7f0e", "#1f77b4", "#2ca02c", "#9467bd"]

ROW_H = 0.28  # one token's row
IN_W = 1.5  # the input features, drawn
OUT_W = 1.5  # the output features, drawn
# Columns (x): the rows, the weights, the result.
X_LEFT, W_LEFT, W_RIGHT, Y_LEFT = 1.05, 2.95, 5.55, 5.95


def adapter_colours(tokens: list[str]) -> dict[str, str]:
    names = [t for t in dict.fromkeys(tokens) if t != "base"]
    return {"base": BASE_COLOUR} | {n: ADAPTER_COLOURS[i % len(ADAPTER_COLOURS)]
                                    for i, n in enumerate(names)}


def block(ax, x: float, y: float, w: float, h: float, colour: str, label: str = "",
          rows: list[str] | None = None, colours: dict | None = None, ink: str = "black"):
    """A matrix as a rectangle (x, y: its lower left); `rows`: one band per row."""
    from matplotlib.patches import Rectangle
    if rows:
        for i, name in enumerate(rows):
            top = y + h - (i + 1) * ROW_H
            ax.add_patch(Rectangle((x, top), w, ROW_H, facecolor=colours[name],
                                   edgecolor="white", linewidth=1.0))
    else:
        ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor="white", linewidth=1.0))
    ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="#404040", linewidth=0.8))
    if label:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=8.5, color=ink)


def shape(ax, x: float, y: float, text: str) -> None:
    ax.text(x, y, text, ha="center", va="top", fontsize=7.5, color="#525252")


def sign(ax, x: float, y: float, text: str) -> None:
    ax.text(x, y, text, ha="center", va="center", fontsize=13, color="#252525")


def draw_base_band(ax, data: dict, colours: dict, bottom: float) -> float:
    """X (T x in) @ W^T (in x out) = Y (T x out); returns Y's middle (y)."""
    from matplotlib.patches import Rectangle
    tokens, t = data["tokens"], len(data["tokens"])
    height = t * ROW_H
    block(ax, X_LEFT, bottom, IN_W, height, "", rows=tokens, colours=colours)
    for i, name in enumerate(tokens):
        ax.text(X_LEFT - 0.08, bottom + height - (i + 0.5) * ROW_H, name, ha="right",
                va="center", fontsize=7.5, color="#404040" if name == "base" else colours[name])
    shape(ax, X_LEFT + IN_W / 2, bottom - 0.06, f"x: {t} tokens x {data['in_features']}")
    middle = bottom + height / 2
    sign(ax, (X_LEFT + IN_W + W_LEFT) / 2, middle, "@")
    w_left = (W_LEFT + W_RIGHT - OUT_W) / 2
    block(ax, w_left, middle - IN_W / 2, OUT_W, IN_W, WEIGHT_COLOUR, "W\u1d40, the base\nweight",
          ink="white")
    shape(ax, w_left + OUT_W / 2, middle - IN_W / 2 - 0.06,
          f"{data['in_features']} x {data['out_features']}")
    sign(ax, (W_RIGHT + Y_LEFT) / 2, middle, "=")
    block(ax, Y_LEFT, bottom, OUT_W, height, "", rows=["base"] * t, colours=colours)
    for i, name in enumerate(tokens):
        if name != "base":  # the rows its adapter's product is added to
            top = bottom + height - (i + 1) * ROW_H
            ax.add_patch(Rectangle((Y_LEFT + OUT_W - 0.22, top + 0.04), 0.18, ROW_H - 0.08,
                                   facecolor=colours[name], edgecolor="none"))
    shape(ax, Y_LEFT + OUT_W / 2, bottom - 0.06, f"y: {t} x {data['out_features']}")
    return middle


def draw_adapter_band(ax, data: dict, name: str, colour: str, middle: float) -> None:
    """x[rows] (R x in) @ A^T (in x r) @ B^T (r x out), added at those rows."""
    rows = [i for i, t in enumerate(data["tokens"]) if t == name]
    height = len(rows) * ROW_H
    rank_w = data["drawn_rank_share"] * IN_W
    bottom = middle - height / 2
    block(ax, X_LEFT, bottom, IN_W, height, colour)
    ax.text(X_LEFT - 0.08, middle, f"{name}'s\nrows", ha="right", va="center", fontsize=7.5,
            color=colour)
    shape(ax, X_LEFT + IN_W / 2, bottom - 0.06, f"{len(rows)} x {data['in_features']}")
    sign(ax, (X_LEFT + IN_W + W_LEFT) / 2, middle, "@")
    a_left = W_LEFT + 0.05
    block(ax, a_left, middle - IN_W / 2, rank_w, IN_W, colour)
    ax.text(a_left + rank_w + 0.05, middle + IN_W / 2 - 0.05, "A\u1d40", ha="left", va="top",
            fontsize=8.5)
    shape(ax, a_left + rank_w / 2, middle - IN_W / 2 - 0.06,
          f"{data['in_features']} x {data['rank']}")
    h_left = a_left + rank_w + 0.45
    sign(ax, h_left - 0.2, middle, "=")
    block(ax, h_left, bottom, rank_w, height, colour)
    shape(ax, h_left + rank_w / 2, bottom - 0.06, f"{len(rows)} x {data['rank']}")
    b_left = W_RIGHT - OUT_W
    sign(ax, (h_left + rank_w + b_left) / 2, middle, "@")
    block(ax, b_left, middle - rank_w / 2, OUT_W, rank_w, colour)
    ax.text(b_left + OUT_W / 2, middle + rank_w / 2 + 0.05, "B\u1d40", ha="center",
            va="bottom", fontsize=8.5)
    shape(ax, b_left + OUT_W / 2, middle - rank_w / 2 - 0.06,
          f"{data['rank']} x {data['out_features']}")
    sign(ax, (W_RIGHT + Y_LEFT) / 2, middle, "=")
    block(ax, Y_LEFT, bottom, OUT_W, height, colour)
    scaling = data["lora_alpha"] / data["rank"]
    shape(ax, Y_LEFT + OUT_W / 2, bottom - 0.06, f"scaled by alpha / r = {scaling:g}")
    ax.text(Y_LEFT + OUT_W + 0.15, middle, f"added to y at rows\n"
            f"{', '.join(map(str, rows))}", ha="left", va="center", fontsize=8, color=colour)


def draw_lora_products(data: list[dict]):
    from pictures.make.pictures import WIDTH_IN, pyplot
    plt = pyplot()
    step = data[0]
    colours = adapter_colours(step["tokens"])
    adapters = [n for n in colours if n != "base"]
    width, height = 10.5, 3.85 + 2.1 * len(adapters)
    fig, ax = plt.subplots(figsize=(WIDTH_IN, WIDTH_IN * height / width))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    fig.suptitle("One step, one projection: the base product once, a thin product per "
                 "adapter", fontsize=12, weight="bold")
    top = height - 0.05
    ax.text(0.1, top, f"1. every token through the base weight: one product ({step['projection']}"
            f" of the embedded SmolLM2)", fontsize=9, va="top", weight="bold")
    base_bottom = top - 0.55 - len(step["tokens"]) * ROW_H
    draw_base_band(ax, step, colours, base_bottom)
    ax.text(Y_LEFT + OUT_W + 0.15, base_bottom + len(step["tokens"]) * ROW_H / 2,
            "W is read once\nfor the whole batch,\nwhatever the adapters", ha="left",
            va="center", fontsize=8, color="#404040")
    below = base_bottom - 0.55
    ax.text(0.1, below, f"2. each adapter's rows through its own A and B (rank "
            f"{step['rank']}, drawn wider than it is): {len(adapters)} thin products",
            fontsize=9, va="top", weight="bold")
    for i, name in enumerate(adapters):
        draw_adapter_band(ax, step, name, colours[name], below - 1.1 - i * 2.1)
    d_in, d_out, r = step["in_features"], step["out_features"], step["rank"]
    ax.text(width / 2, 0.02, f"work per token: the base weight {d_in} x {d_out} = "
            f"{d_in * d_out:,} multiply-adds; its adapter {r} x ({d_in} + {d_out}) = "
            f"{r * (d_in + d_out):,}", ha="center", va="bottom", fontsize=8.5, color="#252525")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return fig
