"""Shared drawing helpers: figures without pyplot, colours, PNG/SVG bytes.

Figures are ``matplotlib.figure.Figure`` objects on the Agg canvas, never registered with
pyplot, so renderers are pure (no global figure state; safe in Streamlit's threads) and the
garbage collector frees them. ``artist_count`` counts what a figure draws: tests bound it, so
a 1024-rank plan cannot make a view draw one artist per rank.
"""

from __future__ import annotations

import io

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

KIND_COLORS: dict[str, str] = {
    "F": "#4C78A8",
    "B": "#59A14F",
    "W": "#B07AA1",
    "SEND": "#F28E2B",
    "RECV": "#EDC948",
    "OPT": "#9C755F",
    "COLL": "#E15759",
    "OTHER": "#BAB0AC",
}
"""Pipeline span kinds (timeline view) and their colours."""

COLLECTIVE_COLORS: dict[str, str] = {
    "all_reduce": "#E15759",
    "reduce_scatter": "#F28E2B",
    "all_gather": "#4C78A8",
    "all_to_all": "#B07AA1",
    "transfer": "#59A14F",
    "slice": "#BAB0AC",
    "partial": "#D4A6C8",
}

MEMORY_COLORS: dict[str, str] = {
    "parameters": "#4C78A8",
    "gradients": "#F28E2B",
    "optimizer_state": "#59A14F",
    "activations": "#E15759",
    "comm_buffers": "#B07AA1",
}

MAX_LABELS = 64
"""Above this many cells or bars a figure draws no per-item text (it would be unreadable)."""


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def empty_notice(ax: Axes, text: str) -> None:
    """An axes with nothing to draw: no frame, ``text`` in its middle."""
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center")


def block_color(index: int) -> str:
    """A distinct colour per block; 20 before they repeat."""
    return to_hex(colormaps["tab20"](index % 20))


def block_name(index: int) -> str:
    """``A``, ``B``, ..., ``Z``, ``AA``, ``AB``, ..."""
    name = ""
    index += 1
    while index:
        index, rem = divmod(index - 1, 26)
        name = chr(ord("A") + rem) + name
    return name


def to_png(fig: Figure, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def to_svg(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg")
    return buf.getvalue()


def artist_count(fig: Figure) -> int:
    """Artists a figure draws (patches, lines, collections, images, texts) over all its axes."""
    total = len(fig.texts)
    for ax in fig.axes:
        total += len(ax.patches) + len(ax.lines) + len(ax.collections) + len(ax.images) + len(ax.texts)
    return total
