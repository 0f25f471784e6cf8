"""Every analysis figure, drawn from the committed results as its script draws it, keeps the rules a
reader's eye needs (analysis/figure_check.py): no two texts overlap, no text leaves the canvas, no
legend covers data, and no panel holds more than ``MAX_SERIES`` series."""

import pytest

from analysis.figure_check import FIGURES, MAX_SERIES, draw_and_measure
from experiments.common import RESULTS_DIR


@pytest.mark.parametrize("name", FIGURES)
def test_figure_has_no_overlap_cut_or_covered_text_and_few_series(name, tmp_path):
    geometry = draw_and_measure(name, RESULTS_DIR, tmp_path / f"{name}.png")
    assert geometry.problems(MAX_SERIES) == [], f"analysis/{name}.py's figure: " + "; ".join(geometry.problems())
    assert (tmp_path / f"{name}.png").stat().st_size > 0


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
    g = measure(fig)
    plt.close(fig)
    assert ("one label", "another label") in g.overlaps
    assert "a text running off the right edge" in g.outside
    assert g.covered and g.busiest == MAX_SERIES + 1
