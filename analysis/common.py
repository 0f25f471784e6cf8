"""What every analysis script shares: reading one run's CSV and config, plot style, README sections.

Each script turns one experiment's ``<results-dir>/<experiment>.csv`` and ``.config.json`` (never a
rerun) into a PNG and into its own section of ``<results-dir>/README.md``. A section sits between
``<!-- begin NAME -->`` and ``<!-- end NAME -->`` and is replaced in place, so scripts run in any
order and leave the other sections alone. Every number in a section is formatted from the CSV, so
the README cannot drift from the data.

A script declares a ``Report`` (name, experiment, title, how to draw, how to write the body) and
calls ``main``; ``--results-dir R --out F`` read from R and draw into F.

Only the committed ``results/`` draws into ``paper_figs/`` and writes ``results/README.md``; results
anywhere else get their figure and README beside them. A quick run's outputs (its config says
``quick`` or ``tiny``, or they lie in ``results/quick``) carry ``QUICK_BANNER`` in the figure's title
and the section, and no verdict: one seed and a few steps are a smoke test, not evidence.
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import matplotlib

from analysis import book
from experiments.harness import tracking
from experiments.harness.common import FIGS_DIR, REPO_ROOT, RESULTS_DIR, read_results, same_file_under

matplotlib.use("Agg")  # before any script imports pyplot: figures are files, never windows

README_HEAD = """# Results

Everything between `<!-- begin NAME -->` and `<!-- end NAME -->` markers is generated, and rerunning
its writer replaces it in place. "Claims in detail" is written by `python analysis/claims.py`, in the
same run and from the same values as the claims table of the top-level README: each row's claim,
verdict and headline with the conditions and caveats behind it and links to the runs' sections
(`python analysis/claims.py --check` fails when either differs from the results). Every other section
is written by one analysis script (`analysis/NAME.py`) from one experiment's CSV and config in this
folder; its setup line names the commit, machine, torch version, wall time and command of the run
that wrote the CSV. The contents list is rewritten with every section. Sections come in the order of
the algorithms (experiments/reproduce.py's list): Disk Sparse Adam, then Gefen, then the Triton
kernels. How to use the optimizers, every option and refusal: [docs/USAGE.md](../docs/USAGE.md).
"""

QUICK_BANNER = "quick: a smoke test, not evidence"
QUICK_README_HEAD = f"""# Results (quick)

**{QUICK_BANNER}.** These sections come from `--quick` runs: one seed, small sizes and few steps. They
show that each experiment and analysis runs; they judge no claim. The committed results and their
verdicts are in the repository's `results/README.md`.
"""
# The verdict words a section of a full run may use; a quick section shows none of them.
VERDICT_WORDS = re.compile(r"\*{0,2}\b(?:not met|met|missed|not reproduced|reproduced)\b\*{0,2}", re.I)

# The registry's optimizers in the order figures and tables list them (their colours: ``PALETTE``).
OPTIMIZERS = ["AdamW", "Adam-mini", "torchao-AdamW8bit", "torchao-AdamW4bit", "gefen-upstream",
              "Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored", "Gefen-4bit-factored", "Gefen-8bit-compact",
              "Gefen-4bit-compact", "gefen-x"]


class ResultsError(ValueError):
    """A results file that an analysis script cannot use; the message names the file."""


# ----------------------------------------------------------------------------------------- routing
def is_committed(results_dir) -> bool:
    """Whether ``results_dir`` is the repository's committed ``results/``."""
    return Path(results_dir).resolve() == RESULTS_DIR.resolve()


def is_quick(config: dict, results_dir) -> bool:
    """Whether these results are a smoke test: the run's config says ``quick`` or ``tiny``, or they
    lie in ``results/quick``."""
    run = config.get("config") or {}
    return bool(run.get("quick") or run.get("tiny")) or Path(results_dir).resolve().is_relative_to(
        (RESULTS_DIR / "quick").resolve())


def is_same_file(path, other) -> bool:
    """Whether both exist and are one file (device and inode): a hard link or a symbolic link to it."""
    return Path(path).exists() and Path(other).exists() and os.path.samefile(path, other)


def without_verdicts(text: str) -> str:
    """``text`` with every verdict word (met, not met, missed, reproduced, not reproduced) as "—"."""
    return VERDICT_WORDS.sub("—", text)


def figure_path(name: str, results_dir, out=None, quick=False) -> Path:
    """Where the figure of results in ``results_dir`` goes: ``out`` if given, else ``paper_figs/`` for
    the committed results of a full run and beside the results for any other. A figure of other
    results is refused inside ``paper_figs/``, which holds only the committed results' figures, and
    on a file of it under another name (a hard link), which drawing would rewrite in place."""
    committed = is_committed(results_dir) and not quick
    path = Path(out) if out is not None else (FIGS_DIR if committed else Path(results_dir)) / f"{name}.png"
    if not committed and (path.resolve().is_relative_to(FIGS_DIR.resolve()) or same_file_under(path, FIGS_DIR)):
        raise ResultsError(f"{path}: paper_figs/ holds the figures of the committed results/ only; the figure of "
                           f"{'a quick run' if quick else results_dir} goes beside its results (leave out --out)")
    return path


# ----------------------------------------------------------------------------------------- reading
def load_rows(experiment: str, results_dir, metrics=()):
    """Rows of ``<results_dir>/<experiment>.csv`` (``value`` a float); raise if it lacks ``metrics``."""
    path = Path(results_dir) / f"{experiment}.csv"
    try:
        rows = read_results(path)
    except ValueError as exc:  # a non-numeric value or missing columns
        raise ResultsError(f"{path}: malformed results file ({exc})") from None
    if not rows:
        raise ResultsError(f"{path}: no rows")
    missing = sorted(set(metrics) - {r["metric"] for r in rows})
    if missing:
        raise ResultsError(f"{path}: no rows of metric(s) {missing}; rerun experiments/{experiment}.py")
    return rows


def load_config(experiment: str, results_dir) -> dict:
    """The run's ``<experiment>.config.json`` ({} when the experiment wrote none)."""
    path = Path(results_dir) / f"{experiment}.config.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not JSON ({exc})") from None


def select(rows, metric=None, variant=None, **where):
    """Rows matching every given column value (``metric``, ``variant`` and any other column)."""
    if metric is not None:
        where["metric"] = metric
    if variant is not None:
        where["variant"] = variant
    if not where:
        return list(rows)
    columns = operator.itemgetter(*where)  # one C-level lookup per row: sections select thousands of times
    want = tuple(where.values()) if len(where) > 1 else next(iter(where.values()))
    return [r for r in rows if columns(r) == want]


def value(rows, metric, variant, **where) -> float:
    """The one value of (metric, variant[, columns]); NaN when absent, the mean if several."""
    vals = [r["value"] for r in select(rows, metric, variant, **where)]
    return statistics.fmean(vals) if vals else math.nan


def variants(rows, metric=None):
    """Variants in the order the experiment wrote them."""
    return list(dict.fromkeys(r["variant"] for r in rows if metric is None or r["metric"] == metric))


# state bytes per parameter each Gefen variant must stay within (gefen_memory's and convergence's claims)
GEFEN_TARGET_BPP = {"Gefen-8bit": 1.05, "Gefen-4bit": 0.55, "Gefen-8bit-factored": 1.06, "Gefen-4bit-factored": 0.56,
                    "Gefen-8bit-compact": 1.06, "Gefen-4bit-compact": 0.56}
TARGET_WIDTH = 128  # the model width (n_embd) from which GEFEN_TARGET_BPP holds; below it Gefen-X's bytes bound


# experiments/harness/data.py's corpora, as the sections name them
CORPUS_TEXT = {"docs+code": "`pydoc_data.topics` plus standard-library sources",
               "docstrings": "the docstrings of the standard library's packages (English prose)"}


def configurations(rows, metric):
    """Variant prefixes of a run's configurations: "" (the first, unprefixed) and "<label>/" for each
    further one (variants ``<label>/<name>``), from the variants that have ``metric``."""
    prefixes = {v.rpartition("/")[0] + "/" for v in variants(rows, metric) if "/" in v}
    return [""] + sorted(prefixes)


def in_configuration(name: str, prefix: str) -> bool:
    """Whether variant ``name`` belongs to the configuration of ``prefix`` (see ``configurations``):
    the prefix and then a name without "/" (``<label>/dropin/<name>`` is not ``<label>/``'s)."""
    return name.startswith(prefix) and "/" not in name[len(prefix):]


def mean_std(vals):
    vals = [v for v in vals if math.isfinite(v)]
    if not vals:
        return math.nan, math.nan
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


# -------------------------------------------------------------------------------------- formatting
def fmt(x, digits=3) -> str:
    """``digits`` significant digits, thousands separators for large numbers, '—' for NaN/None."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if isinstance(x, str):
        return x
    if x == 0:
        return "0"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    if abs(x) < 1e-3:
        return f"{x:.{max(digits - 1, 0)}e}"
    return f"{x:.{digits}g}"


def fixed(x, decimals=4) -> str:
    """``decimals`` places, '—' for NaN/None."""
    return "—" if x is None or not math.isfinite(x) else f"{x:.{decimals}f}"


def pm(mean, std, digits=4) -> str:
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if math.isfinite(mean) else "—"


def md_table(header, body) -> str:
    """A Markdown table from a header list and rows of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def duration(seconds) -> str:
    if seconds is None or not math.isfinite(float(seconds)):
        return "?"
    s = float(seconds)
    return f"{s:.0f} s" if s < 120 else (f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.2f} h")


# registry names that stand for another layout since a time (UTC, ISO, as config.json's "timestamp"), each
# change (since, what a run before it measured under the name) in time order
_UNBOUNDED = "2026-12-07T22:16:00+00:00"  # the factored and compact layouts bound m^ by AdamW's bound since
_UNCLIPPED = "without today's first-moment bound"
# ... to the largest v the state allows an element since; before, to the rank-one estimate of its v
_ESTIMATED = ("2026-12-08T00:27:45+00:00", "with the first-moment bound taken on the rank-one estimate of v")
CHANGED_NAMES = {
    "Gefen-8bit-compact": (("2026-12-07T18:39:00+00:00", "the compact layout with one fp32 column factor a "
                            "matrix, without today's first-moment bound"),
                           (_UNBOUNDED, _UNCLIPPED), _ESTIMATED),
    **{name: ((_UNBOUNDED, _UNCLIPPED), _ESTIMATED) for name in ("Gefen-4bit-compact", "Gefen-8bit-factored",
                                                                  "Gefen-4bit-factored")},
}


def measured_before(config: dict, rows, names=CHANGED_NAMES) -> list:
    """[(name, what it measured)] of the ``names`` among ``rows``' variants (alone or after a prefix's
    "/") that the run of ``config`` (its timestamp, else the rows') measured before they changed: the
    earliest change after the run says what."""
    when = config.get("timestamp") or next((r.get("timestamp") for r in rows if r.get("timestamp")), "")
    have = {str(r.get("variant", "")).rpartition("/")[2] for r in rows}
    out = []
    for name, changes in names.items():
        later = [what for since, what in changes if when and when < since]
        if name in have and later:
            out.append((name, later[0]))
    return out


def measured_before_grouped(config: dict, rows, names=CHANGED_NAMES) -> list:
    """``measured_before``'s names that measured the same thing, joined: [("A, B", "are <what>")]."""
    said = {}
    for name, what in measured_before(config, rows, names):
        said.setdefault(what, []).append(name)
    return [(", ".join(ns), f"{'is' if len(ns) == 1 else 'are'} {what}") for what, ns in said.items()]


def setup_line(config: dict, rows) -> str:
    """Commit, machine, torch, wall time and command of the run, from its config.json.

    Keys absent from the config fall back to the CSV's columns; commits of rows that differ from
    the config's are listed, since a results file should hold one run.
    """
    r0 = rows[0] if rows else {}
    commit = config.get("git_commit") or r0.get("git_commit", "?")
    parts = [f"commit `{commit}`", config.get("device") or r0.get("device", "?"),
             f"torch {config.get('torch_version') or r0.get('torch_version', '?')}",
             f"wall time {duration(config.get('wall_seconds'))}"]
    seeds = sorted({r["seed"] for r in rows if r.get("seed") not in (None, "")}, key=str)
    if seeds:
        parts.append("seed" + ("s " if len(seeds) > 1 else " ") + ", ".join(map(str, seeds)))
    if config.get("timestamp"):
        parts.append(f"run {config['timestamp']}")
    line = "Setup: " + ", ".join(parts) + "."
    others = sorted({r["git_commit"] for r in rows} - {commit})
    if others:
        line += f" **Rows from other commits too:** {', '.join(others)}."
    if config.get("command"):
        line += f" Command: `{config['command']}`."
    for names, what in measured_before_grouped(config, rows):
        line += f" **{names} in this run {what}** (rerun to measure today's)."
    return line


# ---------------------------------------------------------------------------------------- plotting
def colour(name, i=0):
    """The fixed colour of an optimizer name (``colour_of``), else the i-th of tab10."""
    import matplotlib.pyplot as plt

    return colour_of(name) if optimizer_of(name) in PALETTE else plt.get_cmap("tab10")(i % 10)


# Set by ``main`` while a quick run's figure is drawn: ``save_figure`` puts it above the title.
_figure_banner: str | None = None


def suptitle(fig, title=None, fontsize=9):
    """Set ``fig``'s title, with the quick banner as its first line while one is set."""
    if _figure_banner:
        title = _figure_banner + ("\n" + title if title else "")
    if title:
        fig.suptitle(title, fontsize=fontsize)


def save_figure(fig, out, title=None, dpi=130, rect=None):
    """Give ``fig`` its title (see ``suptitle``), lay it out, write it to ``out`` (a PNG path), close it."""
    import matplotlib.pyplot as plt

    if title or fig._suptitle is None:  # a title the draw set itself was set through suptitle
        suptitle(fig, title)
    if fig.get_layout_engine() is None:  # a constrained figure lays itself out when it is saved
        fig.tight_layout(rect=rect) if rect else fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------ figure style
# One colour and one legend label per optimizer, the same in every figure. The baseline is black; this
# library's optimizers in strong colours, one hue per Gefen layout (8-bit dark, 4-bit light): the
# published layout blue, the factored red, the compact orange; DSA green; peers in muted tones, the
# upstream package's published Gefen a pale blue beside ours, Gefen-X (the gefen-x package) a pale purple.
PALETTE = {
    "AdamW": "#000000",
    "AdamW+bf16": "#6b6b6b",
    "SparseAdam": "#404040",
    "Adam-mini": "#a0a0a0",
    "torchao-AdamW8bit": "#b08d57",
    "torchao-AdamW4bit": "#d8c09a",
    "flashoptim-AdamW": "#7f9f7f",
    "bnb-AdamW8bit": "#a07f9f",
    "deepspeed-CPUAdam": "#6f8fa8",
    "gefen-upstream": "#8fb3d9",
    "gefen-x": "#a58ccf",
    "Gefen-8bit": "#1f4e9c",
    "Gefen-4bit": "#5b8fd6",
    "Gefen-8bit-factored": "#c0281f",
    "Gefen-4bit-factored": "#ee7a6b",
    "Gefen-8bit-compact": "#d96c00",
    "Gefen-4bit-compact": "#f2ae55",
    "Gefen-8bit+bf16-sr": "#17a2b8",
    "Gefen-8bit-factored+bf16-sr": "#8e1552",
    "DiskSparseAdam": "#2ca02c",
    "DiskSparseAdam-compact": "#8fd18a",
    "DiskSparseRiemannianAdam": "#00682a",
    "geoopt-SparseRiemannianAdam": "#9fbf9f",
}
# Legend and axis labels: which Gefen is whose (the article's, reproduced here; ours; the packages').
LABELS = {
    "Gefen-8bit": "Gefen 8-bit, published (reproduced)",
    "Gefen-4bit": "Gefen 4-bit, published (reproduced)",
    "Gefen-8bit-factored": "Gefen 8-bit, factored (ours)",
    "Gefen-4bit-factored": "Gefen 4-bit, factored (ours)",
    "Gefen-8bit-compact": "Gefen 8-bit, compact (ours)",
    "Gefen-4bit-compact": "Gefen 4-bit, compact (ours)",
    "Gefen-8bit+bf16-sr": "Gefen 8-bit, published, bf16 weights",
    "Gefen-8bit-factored+bf16-sr": "Gefen 8-bit, factored, bf16 weights (ours)",
    "gefen-upstream": "Gefen, upstream package (published)",
    "gefen-x": "Gefen-X (gefen-x package)",
    "deepspeed-CPUAdam": "DeepSpeed CPU-Adam",
    "AdamW+bf16": "AdamW, bf16 weights",
    # the ablations' short names (experiments/gefen_ablation.py's rows): the factored layout and its peers
    "factored": "Gefen, factored (ours)",
}
# optimizer names the ablation tables use for the registry's (experiments/gefen_ablation.py's CHANGES: "layout"
# is the compact layout's fields at 8 bits, "layout512" at 4)
ALIASES = {"factored": "Gefen-8bit-factored", "factored+layout": "Gefen-8bit-compact",
           "factored+layout512": "Gefen-4bit-compact"}
OURS_PREFIXES = ("Gefen", "DiskSparse", "DSA")
OURS_COLOURS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
PEER_GREYS = ["0.4", "0.55", "0.3", "0.62", "0.48", "0.35"]
BASELINE = "black"
TARGET_BAND = dict(color="#2ca02c", alpha=0.12, linewidth=0)  # the span a claim's target allows


def optimizer_of(name: str) -> str:
    """The optimizer a variant name stands for: ``<config>/`` prefixes dropped, an lr multiple
    (``@0.6``) dropped, then ``+option`` suffixes dropped one at a time until a name of ``PALETTE``
    remains (``Gefen-8bit-factored+bf16-sr+in-backward`` is ``Gefen-8bit-factored+bf16-sr``);
    the bare name when none does."""
    base = name.rsplit("/", 1)[-1].split("@", 1)[0]
    base = ALIASES.get(base, base)
    probe = base
    while probe not in PALETTE and "+" in probe:
        probe = probe.rsplit("+", 1)[0]
        probe = ALIASES.get(probe, probe)
    return probe if probe in PALETTE else base


def colour_of(name: str, default: str = "0.5") -> str:
    """The one colour of optimizer ``name`` in every figure (``PALETTE``, see ``optimizer_of``);
    ``default`` for a name it does not know."""
    return PALETTE.get(optimizer_of(name), default)


def label_of(name: str) -> str:
    """The legend label of optimizer ``name``: ``LABELS``' words for the Gefens (which layout, whose),
    else the name; an lr multiple is kept ("gefen-x@0.6": "Gefen-X (gefen-x package), lr × 0.6")."""
    bare = name.rsplit("/", 1)[-1]
    base, _, lr = bare.partition("@")
    label = LABELS.get(base, base)
    return f"{label}, lr × {lr}" if lr else label


def is_ours(name: str) -> bool:
    """Whether ``name`` (an optimizer or variant, any ``<config>/`` prefix dropped) is this library's."""
    return optimizer_of(name).startswith(OURS_PREFIXES)


def style(name: str, rank: int = 0, baseline: str = "AdamW") -> dict:
    """Plot keywords of optimizer ``name``: its ``PALETTE`` colour (else the ``rank``-th of its kind),
    ours heavier, the baseline black, peers thin."""
    known = optimizer_of(name) in PALETTE
    if name == baseline:
        return dict(color=colour_of(name) if known else BASELINE, linewidth=1.6, zorder=3)
    if is_ours(name):
        return dict(color=colour_of(name) if known else OURS_COLOURS[rank % len(OURS_COLOURS)], linewidth=2.0,
                    zorder=4)
    return dict(color=colour_of(name) if known else PEER_GREYS[rank % len(PEER_GREYS)], linewidth=1.0, zorder=2)


def styles(names, baseline: str = "AdamW") -> dict:
    """{name: ``style``} with ours and peers each ranked in the given order (for names not in ``PALETTE``)."""
    ours = [n for n in names if is_ours(n)]
    peers = [n for n in names if not is_ours(n) and n != baseline]
    return {n: style(n, ours.index(n) if n in ours else peers.index(n) if n in peers else 0, baseline) for n in names}


def names_axis(ax, names, labels=None, order=(), fontsize=7):
    """Optimizer ``names`` down ``ax``'s y axis, the first at the top, ours in colour and bold (one
    colour per optimizer, ranked over ``order`` then ``names``, so that panels agree); ``labels``
    the texts shown (default the names)."""
    look = styles(list(dict.fromkeys([*order, *names])))
    ax.set_yticks(range(len(names)), labels or names, fontsize=fontsize)
    for tick, n in zip(ax.get_yticklabels(), names):
        tick.set_color(look[n]["color"])
        tick.set_fontweight("bold" if is_ours(n) else "normal")
    ax.set_ylim(len(names) - 0.5, -0.5)
    return look


def new_figure(nrows=1, ncols=1, width=6.4, height=3.6, **kwargs):
    """``plt.subplots`` laid out by matplotlib's constrained engine (titles, labels and outside legends
    kept inside the canvas); ``width`` and ``height`` are the whole figure's, in inches."""
    import matplotlib.pyplot as plt

    kwargs.setdefault("squeeze", False)
    return plt.subplots(nrows, ncols, figsize=(width, height), layout="constrained", **kwargs)


def legend_below(ax, ncols=2, fontsize=7, **kwargs):
    """A legend under ``ax``'s axis label, never on its data (constrained layout makes room)."""
    kwargs.setdefault("frameon", False)
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=ncols, fontsize=fontsize, **kwargs)


def figure_legend(fig, handles=None, labels=None, ncols=3, fontsize=7, **kwargs):
    """One legend for the whole figure, below every panel."""
    kwargs.setdefault("frameon", False)
    if handles is None:
        handles, labels = fig.axes[0].get_legend_handles_labels()
    return fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=fontsize, **kwargs)


def finding_title(finding: str, setup: str = "", fig=None) -> str:
    """A figure title: the finding (from the data) first, then the setup it holds in, on its own line;
    wrapped to ``fig``'s width (given) so that it stays on the canvas."""
    import textwrap

    width = int(fig.get_figwidth() * 12) if fig is not None else 10 ** 6  # characters of a 9-point title
    return "\n".join(textwrap.fill(part, width) for part in (finding, setup) if part)


def signed_pct(ratio: float, digits: int = 1) -> str:
    """A ratio to a baseline as a signed percentage ("+0.3%")."""
    return "—" if not math.isfinite(ratio) else f"{(ratio - 1) * 100:+.{digits}f}%"


# ------------------------------------------------------------------------------- README sections
def _markers(name):
    return f"<!-- begin {name} -->", f"<!-- end {name} -->"


def write_section(readme, name: str, text: str, head: str = README_HEAD) -> Path:
    """Put ``text`` between ``name``'s markers in ``readme``: replaced in place, else appended to
    ``head`` (a new README's first lines)."""
    readme = Path(readme)
    begin, end = _markers(name)
    block = f"{begin}\n{text.strip()}\n{end}"
    doc = readme.read_text() if readme.exists() else head
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(doc):
        doc = pattern.sub(lambda _: block, doc, count=1)
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    readme.parent.mkdir(parents=True, exist_ok=True)
    readme.write_text(with_contents(in_section_order(doc)))
    return readme


DETAIL = "claims_detail"  # the section of results/README.md that expands each claim (analysis/claims.py)
_BLOCK = re.compile(r"^<!-- begin (?!contents )(\S+) -->\n.*?\n<!-- end \1 -->$", re.M | re.S)


def section_order() -> list[str]:
    """Section names as results/README.md shows them: the claims' detail first, then every analysis
    script in the order experiments/reproduce.py lists them (one algorithm's sections together)."""
    from experiments.reproduce import EXPERIMENTS

    return [DETAIL, *(name for names in EXPERIMENTS.values() for name in names)]


def in_section_order(doc: str) -> str:
    """``doc`` with its sections sorted by ``section_order`` (a section it does not name keeps its
    place after them). A README with text between its sections (written by hand) is left as it is."""
    blocks = list(_BLOCK.finditer(doc))
    if not blocks:
        return doc
    between = [doc[a.end():b.start()] for a, b in zip(blocks, blocks[1:])] + [doc[blocks[-1].end():]]
    if any(text.strip() for text in between):
        return doc
    rank = {name: i for i, name in enumerate(section_order())}
    ordered = sorted(blocks, key=lambda m: rank.get(m.group(1), len(rank)))
    return doc[:blocks[0].start()] + "\n\n".join(m.group(0) for m in ordered) + "\n"


def with_contents(doc: str) -> str:
    """``doc`` with its contents list (a link to every ``## `` section, in order) between the
    ``contents`` markers, put before the first section or block where there is none: made from the
    headings each time a section is written, so it never lists a section that is gone."""
    begin, end = _markers("contents")
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n*", re.S)
    doc = pattern.sub("", doc)
    titles = [line[3:].strip() for line in doc.splitlines() if line.startswith("## ")]
    if not titles:
        return doc
    items = "\n".join(f"- [{t}](#{anchor(t)})" for t in titles)
    block = f"{begin}\nContents:\n\n{items}\n{end}\n\n"
    first = re.search(r"^(## |<!-- begin )", doc, re.M)  # before the first section, outside every block
    return doc[:first.start()] + block + doc[first.start():]


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def read_section(readme, name: str) -> str | None:
    """The text between ``name``'s markers, or None."""
    begin, end = _markers(name)
    m = re.search(re.escape(begin) + r"\n(.*?)\n" + re.escape(end), Path(readme).read_text(), re.S)
    return m.group(1) if m else None


@dataclass
class Report:
    """One analysis script: ``draw(rows, out, config)`` makes the figure (None: no figure), and
    ``body(rows, config)`` returns the section's Markdown after the setup line (tables, verdicts).
    ``reads`` names other experiments the body compares with: the rows of each whose CSV is in the
    results folder are in ``config["other_rows"][name]``."""

    name: str
    experiment: str
    title: str
    body: Callable
    draw: Callable | None = None
    metrics: tuple = ()
    reads: tuple = ()


def main(report: Report, argv=None, doc=None):
    """Command line of every analysis script: read, draw, write the README section (see the module
    docstring for where a figure and section go, and what a quick run's show)."""
    global _figure_banner
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help="where the CSVs are; the section goes into its README.md")
    if report.draw is not None:
        parser.add_argument("--out", type=Path, default=None,
                            help="PNG to write (default: paper_figs/NAME.png for the committed results/, "
                                 "else beside the results)")
    args = parser.parse_args(argv)
    rows = load_rows(report.experiment, args.results_dir, report.metrics)
    config = load_config(report.experiment, args.results_dir)
    config["other_rows"] = {name: load_rows(name, args.results_dir) for name in report.reads
                            if (Path(args.results_dir) / f"{name}.csv").exists()}
    # a quick run among those read (the experiment's or one it compares with) makes the section quick
    quick_runs = [name for name in [report.experiment, *config["other_rows"]]
                  if is_quick(load_config(name, args.results_dir), args.results_dir)]
    quick = bool(quick_runs)
    if quick and is_committed(args.results_dir):
        raise ResultsError(f"{Path(args.results_dir) / quick_runs[0]}.csv: a quick run's results in the committed "
                           "results/; rerun the experiment without --quick, or with --results-dir results/quick")
    readme = book.page_file(report.name, args.results_dir)  # its page of the committed book, else README.md
    if not is_committed(args.results_dir) and is_same_file(readme, RESULTS_DIR / "README.md"):
        raise ResultsError(f"{readme}: results/README.md under another name (a link to it), which holds the committed "
                           "results' sections only; other results get a README.md of their own: remove this one")
    parts = [f"## {report.title}"] + [f"**{QUICK_BANNER}** (small sizes, few steps: no verdicts)."] * quick
    parts.append(setup_line(config, rows))
    if report.draw is not None:
        out = figure_path(report.name, args.results_dir, args.out, quick)
        _figure_banner = QUICK_BANNER if quick else None
        try:
            report.draw(rows, out, config)
        finally:
            _figure_banner = None
        tracking.log_figure(config, out, report.name, root=REPO_ROOT)  # a run in the experiment's W&B group
        rel = Path(os.path.relpath(out.resolve(), readme.parent.resolve())).as_posix()
        parts.append(f"![{report.name}]({rel})")
        print(f"wrote {out}")
    body = report.body(rows, config).strip()
    parts.append(without_verdicts(body) if quick else body)
    text = "\n\n".join(parts)
    if book.is_page(readme):
        write_section(readme, report.name, book.wrapped(text), head=book.head(readme.stem))
    else:
        write_section(readme, report.name, text, head=QUICK_README_HEAD if quick else README_HEAD)
    print(f"wrote section {report.name} of {readme}")
    return readme


def kind_table(rows, prefix, names):
    """Markdown: the state bytes per parameter of each optimizer (variant ``prefix`` + name) by kind
    of tensor (``state_bytes_per_param_of_kind`` against ``kind``, mean over seeds), all tensors
    first (the kinds weighted by ``params_of_kind``), the kinds' shares of the parameters in the
    header ("shared": state of no one tensor, per parameter of the model); "" without such rows."""
    have = [n for n in names if select(rows, "state_bytes_per_param_of_kind", prefix + n)]
    if not have:
        return ""
    kinds = list(dict.fromkeys(r["x_value"] for r in select(rows, "params_of_kind", prefix + have[0])))
    counts = {k: value(rows, "params_of_kind", prefix + have[0], x_value=k) for k in kinds}
    total = sum(c for c in counts.values() if math.isfinite(c))
    head = ["optimizer", "all tensors"] + [k if k == "shared" else f"{k} ({counts[k] / total:.1%} of parameters)"
                                           for k in kinds]
    table = []
    for n in have:
        per = {k: value(rows, "state_bytes_per_param_of_kind", prefix + n, x_value=k) for k in kinds}
        every = per["shared"] + sum(per[k] * counts[k] for k in kinds if k != "shared" and counts[k]) / total
        table.append([n, fmt(every, 4)] + [fmt(per[k], 4) if k == "shared" or counts[k] else "—" for k in kinds])
    return ("State bytes per parameter by kind of tensor (matrices: projections and heads; embeddings: token "
            "and position tables; vectors: biases and norm gains):\n\n" + md_table(head, table))
