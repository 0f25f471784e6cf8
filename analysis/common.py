"""What every analysis script shares: paths, the Agg backend, and "latest run only" row selection.

Analysis scripts read only ``results/*.csv`` (never rerun experiments) and write one PNG each into
``paper_figs/``. ``--results-dir`` and ``--out`` let tests and ``experiments/reproduce.py --quick``
draw from other CSVs into other files.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from experiments.common import FIGS_DIR, RESULTS_DIR, read_results  # noqa: E402,F401


def add_analysis_args(parser, figure: str):
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the CSVs are")
    parser.add_argument("--out", type=Path, default=FIGS_DIR / f"{figure}.png", help="PNG to write")
    return parser


def latest_run(rows):
    """Keep only the rows of the most recent run of each variant.

    CSVs are append-only, so a rerun adds rows beside the old ones. Every row of one run carries
    the run's start time as its timestamp; per variant, only rows with the newest timestamp stay.
    """
    newest = {}
    for r in rows:
        if r["variant"] not in newest or r["timestamp"] > newest[r["variant"]]:
            newest[r["variant"]] = r["timestamp"]
    return [r for r in rows if r["timestamp"] == newest[r["variant"]]]


def save_figure(fig, out, title=None, dpi=130):
    """Give ``fig`` its setup-line title, lay it out, write it to ``out`` (a PNG path), close it."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
