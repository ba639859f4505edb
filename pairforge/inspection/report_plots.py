"""The report's charts (matplotlib, Agg), each a PNG data URL, every axis labelled.

A histogram of values that barely vary (every image 64 tokens) says nothing as bars and
gets an x-axis such as 63.6-64.4; ``degenerate`` finds those, and the report shows the
number instead.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_SHARD_LINES = 10  # more lines than this are a tangle; the rest are left out (said)
LINE_STYLES = ("-", "--", "-.", ":")


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    pyplot().close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def degenerate(values: np.ndarray) -> bool:
    """Too little spread for bars: one distinct value (or none)."""
    return len(values) == 0 or float(np.max(values)) == float(np.min(values))


def funnel_chart(final: dict[str, int], input_rows: int) -> str:
    plt = pyplot()
    ordered = sorted(final.items(), key=lambda kv: (kv[0] != "ok", -kv[1]))[::-1]
    fig, ax = plt.subplots(figsize=(7.5, 0.38 * len(ordered) + 1.2))
    colours = ["#55a868" if k == "ok" else "#c44e52" for k, _ in ordered]
    bars = ax.barh([k for k, _ in ordered], [v for _, v in ordered], color=colours)
    ax.bar_label(bars, labels=[f"{v:,} ({v / max(input_rows, 1):.1%})" for _, v in ordered],
                 padding=3, fontsize=8)
    ax.set_xlabel("rows")
    ax.set_ylabel("final status")
    ax.set_xlim(0, max(v for _, v in ordered) * 1.3 if ordered else 1)
    ax.set_title(f"where the {input_rows:,} input rows ended")
    return png(fig)


def histogram(values: np.ndarray, xlabel: str, title: str,
              bounds: Sequence[tuple[float, str]] = ()) -> str:
    """Counts of ``values`` with a vertical line per (value, label) bound."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3))
    ax.hist(values, bins=40, color="#4c72b0")
    for value, label in bounds:
        ax.axvline(value, color="#c44e52", linestyle="--", label=label)
    if bounds:
        ax.legend(fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("rows")
    ax.set_title(title)
    return png(fig)


def prefix_share_chart(shares: dict[str, np.ndarray], target: float, total_shards: int) -> str:
    """The unconditional image-token share along each shard's prefix, one line per shard
    (colour and dash both vary, so equal shards stay told apart), against the target."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    colours = plt.get_cmap("tab10").colors
    for i, (name, share) in enumerate(shares.items()):
        ax.plot(np.arange(1, len(share) + 1), share, linewidth=1.1,
                color=colours[i % len(colours)], linestyle=LINE_STYLES[i % len(LINE_STYLES)],
                label=f"shard {name}")
    ax.axhline(target, color="black", linewidth=1.5, label=f"target p_drop {target:g}")
    ax.set_xlabel("samples into the shard")
    ax.set_ylabel("i2t + img share of image tokens")
    ax.set_ylim(0, min(1.0, max([target * 3] + [float(np.max(s[len(s) // 10:]))
                                                  for s in shares.values() if len(s)])))
    shown = f"{len(shares)} of {total_shards} shards" if total_shards > len(shares) else \
        f"{total_shards} shard{'s' * (total_shards != 1)}"
    ax.set_title(f"i2t share along each shard's prefix ({shown})")
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    return png(fig)
