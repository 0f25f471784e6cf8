"""The geometry of a drawn figure: what overlaps, what is cut, what a legend covers, how busy a panel is.

    python analysis/figure_check.py [--results-dir results] [NAME ...]

draws each analysis script's figure from the results (Agg, at the size and resolution it is saved)
and prints, per figure, the counts that a reader's eye trips on:

- ``overlaps``: pairs of texts (titles, axis and tick labels, annotations, legend texts) whose boxes
  intersect;
- ``outside``: texts that leave the canvas (cut in the PNG);
- ``covered``: data marks (a line's points, a bar, a scatter point) under a legend's box;
- ``series``: series in the busiest panel (lines, scatter sets, error bars; a bar set counts its bars
  when it is the panel's only one, since then each bar is one optimizer).

``measure(fig)`` does it for one figure (and keeps its texts); ``draw_and_measure(name, results_dir)``
for one figure of ``figure_reports()``, every figure an analysis script draws. tests/test_figures.py
holds every figure to 0, 0, 0 and at most ``MAX_SERIES``.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import contextlib
import importlib
import itertools
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import matplotlib

matplotlib.use("Agg")
from matplotlib.container import BarContainer, ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.collections import PathCollection
from matplotlib.text import Text

MAX_SERIES = 8
SLACK = 0.5  # pixels two boxes may share (anti-aliasing), and a text may pass the canvas's edge

def figure_reports() -> dict:
    """{figure name: its ``Report``} of every analysis script that draws one, found by importing each
    module of analysis/ and taking every ``Report`` with a ``draw`` it defines (alone, or in a list,
    tuple or dict): no list to keep by hand."""
    import pkgutil

    import analysis
    from analysis.common import Report

    found = {}
    for info in sorted(pkgutil.iter_modules(analysis.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in ("figure_check",):
            continue
        module = importlib.import_module(f"analysis.{info.name}")
        for obj in vars(module).values():
            items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else [obj]
            for report in items:
                if isinstance(report, Report) and report.draw is not None:
                    found.setdefault(report.name, report)
    return dict(sorted(found.items()))


@dataclass
class Geometry:
    """The counts of one figure, and what each count is made of (for a message that names it)."""

    title: str = ""  # the figure's title (its suptitle)
    texts: list = field(default_factory=list)  # every text drawn, as drawn (titles, labels, ticks, legends)
    overlaps: list = field(default_factory=list)  # (text, text) pairs
    outside: list = field(default_factory=list)  # texts
    covered: list = field(default_factory=list)  # (legend's first text, what it covers)
    series: dict = field(default_factory=dict)  # panel title -> series

    @property
    def busiest(self) -> int:
        return max(self.series.values(), default=0)

    def counts(self) -> tuple:
        return len(self.overlaps), len(self.outside), len(self.covered), self.busiest

    def problems(self, max_series=MAX_SERIES) -> list[str]:
        """Each defect in words; [] when the figure keeps every rule."""
        out = [f"texts overlap: {a!r} and {b!r}" for a, b in self.overlaps]
        out += [f"text outside the canvas: {t!r}" for t in self.outside]
        out += [f"legend {leg!r} covers {what}" for leg, what in self.covered]
        out += [f"{n} series in panel {p!r} (at most {max_series})" for p, n in self.series.items() if n > max_series]
        return out


# ------------------------------------------------------------------------------------------ texts
def _tick_label_ids(fig) -> set:
    ids = set()
    for ax in fig.axes:
        for axis in ax._axis_map.values():
            for tick in itertools.chain(axis.majorTicks, axis.minorTicks):
                ids.update((id(tick.label1), id(tick.label2)))
    return ids


def _drawn_tick_labels(fig):
    for ax in fig.axes:
        if not ax.get_visible() or not ax.axison:
            continue
        for axis in ax._axis_map.values():
            if not axis.get_visible():
                continue
            for tick in axis._update_ticks():
                yield from (t for t in (tick.label1, tick.label2) if t.get_visible())


def _shown(t: Text) -> bool:
    """Whether ``t`` is drawn: visible, non-empty, in a visible panel (if any)."""
    return t.get_visible() and bool(t.get_text().strip()) and (t.axes is None or t.axes.get_visible())


def texts(fig) -> list[Text]:
    """Every text the figure draws: titles, axis and tick labels, annotations, legends' texts."""
    ticks = _tick_label_ids(fig)
    found = [t for t in fig.findobj(Text) if id(t) not in ticks and _shown(t)]
    found += [t for t in _drawn_tick_labels(fig) if t.get_text().strip()]
    return list({id(t): t for t in found}.values())


def _box(artist, renderer):
    return artist.get_window_extent(renderer)


def _intersect(a, b, slack=SLACK) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > slack) and (min(a.y1, b.y1) - max(a.y0, b.y0) > slack)


# ------------------------------------------------------------------------------------- data marks
def _is_data(artist, ax) -> bool:
    """Whether ``artist`` is placed in ``ax``'s data coordinates (not a reference line across the axes)."""
    return artist.get_transform().contains_branch(ax.transData)


def _points(line: Line2D, ax) -> np.ndarray:
    xy = np.asarray(line.get_xydata(), float)
    xy = xy[np.isfinite(xy).all(axis=1)]
    return line.get_transform().transform(xy) if len(xy) else xy.reshape(0, 2)


def _marks(ax, renderer):
    """(name, display box or point) of every data mark in ``ax``: line points, bars, scatter points,
    each as drawn (clipped to the panel)."""
    clip = ax.bbox
    for line in ax.lines:
        if line.get_visible() and _is_data(line, ax):
            for x, y in _along(line, ax):
                if not line.get_clip_on() or (clip.x0 <= x <= clip.x1 and clip.y0 <= y <= clip.y1):
                    yield line.get_label(), (x, y)
    for patch in ax.patches:
        if patch.get_visible() and isinstance(patch, Rectangle) and _is_data(patch, ax):
            box = patch.get_window_extent(renderer)
            if patch.get_width() and patch.get_height() and np.isfinite(box.extents).all():  # a NaN bar is not drawn
                box = Bbox.intersection(box, clip) if patch.get_clip_on() else box
                if box is not None:
                    yield patch.get_label() or "bar", box
    for coll in ax.collections:
        if coll.get_visible() and isinstance(coll, PathCollection):
            offsets = coll.get_offset_transform().transform(np.asarray(coll.get_offsets(), float))
            for x, y in offsets[np.isfinite(offsets).all(axis=1)]:
                if not coll.get_clip_on() or (clip.x0 <= x <= clip.x1 and clip.y0 <= y <= clip.y1):
                    yield coll.get_label(), (x, y)


def _along(line: Line2D, ax, per_segment=16) -> np.ndarray:
    """A line's points, and where it is drawn between them ``per_segment`` points per segment."""
    pts = _points(line, ax)
    if len(pts) < 2 or line.get_linestyle() in ("None", "none", " ", ""):
        return pts
    t = np.linspace(0, 1, per_segment, endpoint=False)[None, :, None]
    between = pts[:-1, None, :] + t * (pts[1:, None, :] - pts[:-1, None, :])
    return np.concatenate([between.reshape(-1, 2), pts[-1:]])


def _under(box, mark) -> bool:
    if isinstance(mark, tuple):
        x, y = mark
        return box.x0 + SLACK < x < box.x1 - SLACK and box.y0 + SLACK < y < box.y1 - SLACK
    return _intersect(box, mark)


def _legends(fig) -> list[Legend]:
    found = [leg for leg in fig.legends] + [ax.get_legend() for ax in fig.axes]
    return [leg for leg in found if leg is not None and leg.get_visible()]


# ----------------------------------------------------------------------------------------- series
def _series(ax) -> int:
    """Series in ``ax``: lines, scatter sets and error-bar sets in data coordinates; a bar set is
    one series, or its bars when it is the panel's only bar set (one bar per optimizer)."""
    contained, n = set(), 0
    bars = []
    for c in ax.containers:
        contained.update(id(a) for a in _flat(c))
        if isinstance(c, BarContainer):
            bars.append(len([p for p in c.patches if p.get_visible()]))
        elif isinstance(c, ErrorbarContainer):
            n += 1
    n += len(bars) if len(bars) > 1 else sum(bars)
    n += sum(1 for line in ax.lines if id(line) not in contained and line.get_visible() and _is_data(line, ax)
             and len(_points(line, ax)) > 0)
    n += sum(1 for c in ax.collections if id(c) not in contained and isinstance(c, PathCollection) and c.get_visible()
             and len(c.get_offsets()))  # an empty scatter is a legend's proxy: nothing drawn
    return n


def _flat(container):
    for a in container:
        if isinstance(a, (tuple, list)):
            yield from _flat(a)
        elif a is not None:
            yield a


def _panel_name(ax, i) -> str:
    title = ax.get_title() or ax.get_title("left") or ax.get_ylabel()
    return f"{i}: {title.splitlines()[0][:60]}" if title else str(i)


# --------------------------------------------------------------------------------------- measuring
def measure(fig: Figure) -> Geometry:
    """The geometry of ``fig`` as it is drawn at its size and dpi (lay it out first)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    g = Geometry()
    shown = texts(fig)
    g.texts = [t.get_text() for t in shown]
    g.title = fig._suptitle.get_text() if fig._suptitle is not None else ""
    boxes = [(t, _box(t, renderer)) for t in shown]
    canvas = fig.bbox
    for (t1, b1), (t2, b2) in itertools.combinations(boxes, 2):
        if _intersect(b1, b2):
            g.overlaps.append((t1.get_text(), t2.get_text()))
    for t, b in boxes:
        if b.x0 < canvas.x0 - SLACK or b.y0 < canvas.y0 - SLACK or b.x1 > canvas.x1 + SLACK or b.y1 > canvas.y1 + SLACK:
            g.outside.append(t.get_text())
    for leg in _legends(fig):
        box = leg.get_window_extent(renderer)
        name = next((t.get_text() for t in leg.get_texts()), "legend")
        for ax in fig.axes:
            for label, mark in _marks(ax, renderer):
                if _under(box, mark):
                    g.covered.append((name, label))
    for i, ax in enumerate(fig.axes):
        if ax.get_visible() and ax.axison or ax.lines or ax.patches:
            g.series[_panel_name(ax, i)] = _series(ax)
    return g


@contextlib.contextmanager
def capturing():
    """Within: every ``Figure.savefig`` also measures the figure as saved, at the dpi it is saved
    with (text extents do not scale with the dpi: hinting moves them, so a lower dpi would judge
    another figure); yields the list of ``(path, Geometry)`` it fills."""
    found = []
    original = Figure.savefig

    def savefig(fig, fname, *args, **kwargs):
        result = original(fig, fname, *args, **kwargs)
        at = kwargs.get("dpi")
        old = fig.dpi
        if isinstance(at, (int, float)):
            fig.set_dpi(at)
        try:
            found.append((fname, measure(fig)))
        finally:
            fig.set_dpi(old)
        return result

    Figure.savefig = savefig
    try:
        yield found
    finally:
        Figure.savefig = original


def draw_and_measure(name: str, results_dir, out=None) -> Geometry:
    """Draw the figure ``name`` (``figure_reports``) from ``results_dir`` into ``out`` (a temporary
    file when None), as its script would, and measure it."""
    from analysis import common

    reports = figure_reports()
    if name not in reports:
        raise ValueError(f"figure {name!r}: no analysis script draws it; the figures are {sorted(reports)}")
    report = reports[name]
    rows = common.load_rows(report.experiment, results_dir, report.metrics)
    config = common.load_config(report.experiment, results_dir)
    config["other_rows"] = {n: common.load_rows(n, results_dir) for n in report.reads
                            if (Path(results_dir) / f"{n}.csv").exists()}
    with tempfile.TemporaryDirectory() as tmp, capturing() as found:
        report.draw(rows, Path(out) if out else Path(tmp) / f"{name}.png", config)
    if not found:
        raise RuntimeError(f"analysis script of figure {name!r} drew no figure")
    return found[-1][1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    parser.add_argument("--verbose", "-v", action="store_true", help="name each defect")
    parser.add_argument("names", nargs="*", help="figures to check (default: every figure of figure_reports)")
    args = parser.parse_args(argv)
    args.names = args.names or list(figure_reports())
    print(f"{'figure':30} texts overlaps outside covered series")
    bad = 0
    for name in args.names:
        g = draw_and_measure(name, args.results_dir)
        o, c, u, s = g.counts()
        bad += bool(g.problems())
        print(f"{name:30} {len(g.texts):5d} {o:8d} {c:7d} {u:7d} {s:6d}")
        if args.verbose:
            for p in g.problems():
                print("    " + p)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
