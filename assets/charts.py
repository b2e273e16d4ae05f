"""Charts the Dagster UI shows in a materialisation: small PNG images drawn with matplotlib's Agg canvas (no
display, no pyplot state shared between threads), embedded as a base64 data URI in Markdown metadata, which the
UI renders as an image (``MetadataValue.md``)."""
from __future__ import annotations

import base64
import io
import math
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

COLUMNS = 3
PANEL_INCHES = (3.0, 1.9)
DPI = 72  # 3 panels of 3 inches: 648 pixels wide, small enough for the event log and the asset page
# each panel's margins in inches (tick labels and y offset text left, title top, tick labels and x label bottom):
# a fixed layout: matplotlib's tight_layout measures every text first, half of a chart's render, and charts are
# drawn on the RL loop's critical path
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 0.52, 0.12, 0.3, 0.3
MARKERS_BELOW = 12  # a series of fewer points marks each one
KEPT_FIGURES = 8  # line charts kept for their next render with new data (see ``_KeptFigure``)


@dataclass
class Chart:
    """A rendered chart: its PNG bytes and, per panel title, how many series (lines or bar groups) it draws."""

    png: bytes
    panels: dict[str, int] = field(default_factory=dict)

    def markdown(self, title: str) -> str:
        return f"![{title}](data:image/png;base64,{base64.b64encode(self.png).decode()})"

    @property
    def size(self) -> tuple[int, int]:
        return png_size(self.png)


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG image")
    return struct.unpack(">II", png[16:24])


def _grid(n_panels: int, pad_bottom: float = PAD_BOTTOM) -> tuple[Figure, list]:
    columns = min(COLUMNS, n_panels)
    rows = -(-n_panels // columns)
    width, height = PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows
    figure = Figure(figsize=(width, height), dpi=DPI)
    axes_width, axes_height = PANEL_INCHES[0] - PAD_LEFT - PAD_RIGHT, PANEL_INCHES[1] - PAD_TOP - pad_bottom
    figure.subplots_adjust(left=PAD_LEFT / width, right=1 - PAD_RIGHT / width, bottom=pad_bottom / height,
                           top=1 - PAD_TOP / height, wspace=(PAD_LEFT + PAD_RIGHT) / axes_width,
                           hspace=(PAD_TOP + pad_bottom) / axes_height)
    axes = figure.subplots(rows, columns, squeeze=False).ravel().tolist()
    for unused in axes[n_panels:]:
        unused.set_visible(False)
    return figure, axes[:n_panels]


def _render(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


def _finite(values: list) -> bool:
    return any(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


@dataclass
class _KeptFigure:
    """A drawn line chart kept for the next chart of the same panels and series: its lines take the new points and
    the figure is drawn again, without building axes, lines and ticks anew — half a render (13 panels: 0.36 ->
    0.18 s on the dev box); the per-step chart of every RL iteration's update and the chain chart repeat theirs."""

    figure: Figure
    lines: dict[tuple[str, str], tuple]  # (panel, series) -> (axes, line)
    lock: threading.Lock = field(default_factory=threading.Lock)


_kept: OrderedDict[tuple, _KeptFigure] = OrderedDict()
_kept_lock = threading.Lock()


def _points(xy: tuple[list[int], list[float]]) -> tuple[list[int], list[float]]:
    return xy[0], [y if isinstance(y, (int, float)) else math.nan for y in xy[1]]


def _draw_lines(drawable: dict[str, dict[str, tuple[list[int], list[float]]]], xlabel: str) -> _KeptFigure:
    figure, axes = _grid(len(drawable))
    lines = {}
    for ax, (title, series) in zip(axes, drawable.items()):
        for name, xy in series.items():
            xs, ys = _points(xy)
            lines[title, name] = (ax, ax.plot(xs, ys, linewidth=1.2, marker="o" if len(xs) < MARKERS_BELOW else None,
                                              markersize=3, label=name.removeprefix(f"{title}/"))[0])
        ax.set_title(title, fontsize=9)
        # few ticks: every tick label is text that Agg lays out and draws, most of a chart's render
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))  # steps and iterations are whole numbers
        ax.yaxis.set_major_locator(MaxNLocator(nbins=4))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=6, frameon=False)
    figure.supxlabel(xlabel, fontsize=7, y=0.004)  # one axis label for all panels: they share the x quantity
    return _KeptFigure(figure, lines)


def _redraw_lines(kept: _KeptFigure, drawable: dict[str, dict[str, tuple[list[int], list[float]]]]) -> None:
    for title, series in drawable.items():
        for name, xy in series.items():
            ax, line = kept.lines[title, name]
            xs, ys = _points(xy)
            line.set_data(xs, ys)
    for ax in {ax for ax, _ in kept.lines.values()}:
        ax.relim()
        ax.autoscale_view()


def line_panels(panels: dict[str, dict[str, tuple[list[int], list[float]]]], xlabel: str = "step") -> Chart:
    """One small panel per entry of ``panels`` (``{title: {series name: (xs, ys)}}``), each series a line;
    series with no finite value are left out, and so is a panel left empty. Raises ``ValueError`` on no panel.
    A chart of the same panels and series as one drawn before reuses that figure (``_KeptFigure``)."""
    drawable = {title: {name: xy for name, xy in series.items() if _finite(xy[1])} for title, series in panels.items()}
    drawable = {title: series for title, series in drawable.items() if series}
    if not drawable:
        raise ValueError("line_panels: no series with a finite value to draw")
    shown = {title: len(series) for title, series in drawable.items()}
    # what a kept figure must share: panels, series and whether each shows markers (the legend's handles copy them)
    layout = (xlabel, tuple((title, tuple((name, len(xy[0]) < MARKERS_BELOW) for name, xy in series.items()))
                            for title, series in drawable.items()))
    with _kept_lock:
        kept = _kept.get(layout)
        if kept is not None:
            _kept.move_to_end(layout)
    if kept is not None and kept.lock.acquire(blocking=False):  # in use by another thread: draw a new one
        try:
            _redraw_lines(kept, drawable)
            return Chart(_render(kept.figure), shown)
        finally:
            kept.lock.release()
    drawn = _draw_lines(drawable, xlabel)
    png = _render(drawn.figure)
    if kept is None:
        with _kept_lock:
            _kept[layout] = drawn
            while len(_kept) > KEPT_FIGURES:
                _kept.popitem(last=False)
    return Chart(png, shown)


def grouped_bars(panels: dict[str, dict[str, dict[str, float]]]) -> Chart:
    """One panel per entry of ``panels`` (``{title: {group: {model: value}}}``): per group (e.g. a category) a bar
    per model side by side, one colour per model across panels, so models compare at a glance."""
    panels = {title: groups for title, groups in panels.items() if groups}
    if not panels:
        raise ValueError("grouped_bars: nothing to draw")
    models = list(dict.fromkeys(m for groups in panels.values() for values in groups.values() for m in values))
    colours = {m: f"C{i % 10}" for i, m in enumerate(models)}
    figure, axes = _grid(len(panels), pad_bottom=0.5)  # room for the group names, turned when many
    drawn = {}
    for ax, (title, groups) in zip(axes, panels.items()):
        width = 0.8 / len(models)
        for i, model in enumerate(models):
            xs = [g + (i - (len(models) - 1) / 2) * width for g, values in enumerate(groups.values()) if model in values]
            ys = [values[model] for values in groups.values() if model in values]
            if xs:
                ax.bar(xs, ys, width=width, color=colours[model], label=model)
        # a pair source is a path (logged/prefs_000.jsonl): its file name is what tells groups apart
        ax.set_xticks(range(len(groups)), [g.rsplit("/", 1)[-1] for g in groups], fontsize=6,
                      rotation=15 if len(groups) > 2 else 0)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3)
        drawn[title] = len({m for values in groups.values() for m in values})
    axes[0].legend(fontsize=6, frameon=False)
    return Chart(_render(figure), drawn)
