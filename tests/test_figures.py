"""Every analysis figure, drawn from the committed results as its script draws it, keeps the rules a
reader's eye needs (analysis/figure_check.py): no two texts overlap, no text leaves the canvas, no
legend covers data, and no panel holds more than ``MAX_SERIES`` series. The figures are found, not
listed: every ``Report`` with a ``draw`` in analysis/ (``figure_check.figure_reports``). Drawing all
of them from the committed CSVs takes about half a minute."""

import re

import pytest

from analysis.figure_check import MAX_SERIES, figure_reports
from experiments.harness.common import FIGS_DIR, REPO_ROOT
from tests.utils import committed_figure as drawn

FIGURES = list(figure_reports())


def test_every_figure_an_analysis_script_draws_is_checked():
    """Each script that saves a figure declares its Report (so figure_reports finds it), and the
    committed figures are exactly the ones found."""
    saving = {p.stem for p in (REPO_ROOT / "analysis").glob("*.py")
              if p.stem not in ("common", "figure_check") and re.search(r"save_figure\(|\.savefig\(", p.read_text())}
    modules = {getattr(r.draw, "func", r.draw).__module__.rpartition(".")[2] for r in figure_reports().values()}
    assert saving - modules == set(), "analysis scripts that save a figure but declare no Report with a draw"
    assert {p.stem for p in FIGS_DIR.glob("*.png")} == set(FIGURES)


@pytest.mark.parametrize("name", FIGURES)
def test_figure_has_no_overlap_cut_or_covered_text_and_few_series(name):
    geometry = drawn(name)
    assert geometry.texts, f"figure {name} drew no text"
    assert geometry.problems(MAX_SERIES) == [], f"figure {name}: " + "; ".join(geometry.problems())


def test_figure_titles_are_distinct():
    """No two figures share a title: each says its own setup."""
    titles = {}
    for name in FIGURES:
        title = drawn(name).title
        assert title, f"figure {name} has no title"
        assert title not in titles, f"figures {titles[title]} and {name} share the title {title!r}"
        titles[title] = name


def test_figure_check_finds_overlap_cut_text_covered_data_and_busy_panels():
    """The checker itself, on a figure made to break each rule once."""
    import matplotlib.pyplot as plt

    from analysis.figure_check import measure

    fig, ax = plt.subplots(figsize=(3, 2))
    for i in range(MAX_SERIES + 1):
        ax.plot([0, 1], [i, i], label=f"s{i}")
    ax.legend(loc="center")  # on the lines
    ax.text(0.5, 4, "one label")
    ax.text(0.5, 4, "another label")  # on the first
    fig.text(0.95, 0.5, "a text running off the right edge")
    fig.suptitle("the title")
    g = measure(fig)
    plt.close(fig)
    assert ("one label", "another label") in g.overlaps
    assert "a text running off the right edge" in g.outside
    assert g.covered and g.busiest == MAX_SERIES + 1
    assert g.title == "the title" and "one label" in g.texts
