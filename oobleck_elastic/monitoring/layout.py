"""Pictures of a run, drawn with matplotlib: a generation's layout (which worker runs which
layers of which pipeline) and throughput over the steps, with the membership changes marked.

Figures are built on `matplotlib.figure.Figure` with the Agg canvas, never through pyplot, so
no global state or display is involved. `render` draws one once, into the pixels the caller
writes as a PNG next to the logs (`save_png`) and logs to TensorBoard: `savefig` and
`SummaryWriter.add_figure` each drew it again (the reporting worker draws a layout before a
generation's first step, which every worker waits for; 60 ms instead of 120-230 ms here, alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure

__all__ = ["layout_figure", "render", "save_png", "throughput_figure"]


def _figure(width: float, height: float) -> Figure:
    # imported here: only the reporting worker draws, and only when a generation starts
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # attaches the canvas that savefig and TensorBoard render with
    return fig


def render(fig: Figure) -> np.ndarray:
    """The figure's pixels: height x width x RGBA, uint8 (drawn once)."""
    import numpy as np

    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba()).copy()  # type: ignore[attr-defined]


def save_png(pixels: np.ndarray, path: str) -> None:
    from matplotlib.image import imsave

    imsave(path, pixels)


def layout_figure(rows: Sequence[tuple[int, int, int, Sequence[int]]], num_layers: int, title: str) -> Figure:
    """One row per worker, `rows` = (pipeline, node, local_rank, layers held), grouped by
    pipeline; a worker's layers are bars in its pipeline's colour."""
    fig = _figure(min(16.0, 3.0 + 0.25 * num_layers), 1.2 + 0.3 * len(rows))
    ax = fig.add_subplot()
    palette = [f"C{i}" for i in range(10)]
    for y, (pipeline, _, _, layers) in enumerate(rows):
        ax.broken_barh([(layer, 0.9) for layer in layers], (y - 0.4, 0.8), color=palette[pipeline % len(palette)])
    ax.set_yticks(range(len(rows)), [f"p{p} n{n} w{w}" for p, n, w, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, num_layers)
    ax.set_xlabel("layer")
    ax.set_title(title)
    return fig


def throughput_figure(steps: Sequence[int], samples_per_s: Sequence[float],
                      changes: Sequence[tuple[int, str]], title: str) -> Figure:
    """Samples per second at each step, with a vertical line at each membership change
    (step, label: 'lost [1]', say)."""
    fig = _figure(8.0, 3.5)
    ax = fig.add_subplot()
    ax.plot(steps, samples_per_s, marker=".", linewidth=1)
    for step, label in changes:
        ax.axvline(step, color="C3", linestyle="--", linewidth=1)
        ax.annotate(label, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                    fontsize=8, color="C3")
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    return fig
