"""A figure shows its claim's headline as the README's claims table does: the same numbers, in the
same convention (speeds as "×", losses as signed percentages over AdamW's, mean or median as the row
says). Each claims row is computed from the committed results (analysis/claims_*.py) and its
headline's leading numbers are looked up among the texts its figure draws."""

import functools
import re

import pytest

from analysis import claims_dsa, claims_gefen
from analysis.claims_common import Results
from experiments.harness.common import RESULTS_DIR
from tests.utils import committed_figure

NUMBER = re.compile(r"[+−-]?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?[×%]?")
# claims row -> how many of its headline's numbers, from the first, its figure shows
SHOWN = {
    claims_dsa.dsa_speed: 6,
    claims_dsa.dsa_seed_benchmark: 3,
    claims_dsa.dsa_no_device_memory: 3,
    claims_dsa.dsa_out_of_core: 2,
    claims_dsa.dsa_distributed: 3,
    claims_dsa.dsa_poincare: 7,
    claims_gefen.gefen_memory: 5,
    claims_gefen.gefen_quality: 3,
    claims_gefen.gefen_factored: 6,
    claims_gefen.gefen_encoder: 2,
    claims_gefen.gefen_llama: 2,
    claims_gefen.gefen_long: 4,
    claims_gefen.gefen_bf16: 2,
    claims_gefen.gefen_codebook: 4,
    claims_gefen.gefen_speed: 5,
    claims_gefen.gefen_peak_memory: 9,
    claims_gefen.gefen_hessian: 3,
}


@functools.lru_cache(maxsize=None)
def _results():
    return Results(RESULTS_DIR)


def _figure_of(row) -> str:
    return re.search(r"paper_figs/(\w+)\.png", row.figure).group(1)


@pytest.mark.parametrize("claim", list(SHOWN), ids=lambda f: f.__name__)
def test_figure_shows_its_claims_headline_numbers(claim):
    row = claim(_results())
    numbers = NUMBER.findall(row.headline)[:SHOWN[claim]]
    texts = "\n".join(committed_figure(_figure_of(row)).texts)
    missing = [n for n in numbers if n not in texts]
    assert not missing, f"{_figure_of(row)}.png lacks {missing} of the README's headline {row.headline!r}"
