"""One colour and one label per optimizer in every figure (analysis/common.py's ``PALETTE``)."""

import matplotlib.colors as mcolors
import pytest

from analysis.common import LABELS, PALETTE, colour_of, label_of, optimizer_of
from experiments.harness.registry import OPTIMIZERS


def test_every_registered_optimizer_has_a_palette_colour():
    assert set(OPTIMIZERS) - set(PALETTE) == set()


def test_palette_colours_are_distinct():
    """No two optimizers share a colour (compared as RGB, so "0.5" and "#808080" count as one)."""
    rgb = {name: mcolors.to_hex(c) for name, c in PALETTE.items()}
    seen = {}
    for name, c in rgb.items():
        assert c not in seen, f"{name} and {seen[c]} share colour {c}"
        seen[c] = name


@pytest.mark.parametrize("variant, optimizer", [
    pytest.param("char-gpt-1266k/dropin/gefen-x@0.6", "gefen-x", id="prefixes-and-lr-multiple"),
    pytest.param("gpt-12.7M/mb4/Gefen-8bit-factored+bf16-sr+in-backward", "Gefen-8bit-factored+bf16-sr",
                 id="longest-known-option-prefix"),
    pytest.param("mlp/Gefen-4bit+in-backward", "Gefen-4bit", id="option-dropped"),
    pytest.param("factored+refresh", "Gefen-8bit-factored", id="ablation-name"),
    pytest.param("factored+layout", "Gefen-8bit-compact", id="ablation-compact-layout"),
    pytest.param("gefen_ablation_4bit/factored+layout512", "Gefen-4bit-compact", id="ablation-compact-4bit-layout"),
    pytest.param("ddp/AdamW", "AdamW", id="baseline"),
])
def test_a_variant_takes_its_optimizers_colour(variant, optimizer):
    assert optimizer_of(variant) == optimizer
    assert colour_of(variant) == PALETTE[optimizer]


def test_our_gefen_layouts_are_told_apart_from_the_published_gefen_and_gefen_x():
    """By colour and by label: the factored and compact layouts say "ours", the published one
    "published", Gefen-X its package."""
    ours = ["Gefen-8bit-factored", "Gefen-4bit-factored", "Gefen-8bit-compact", "Gefen-4bit-compact"]
    theirs = ["Gefen-8bit", "Gefen-4bit", "gefen-upstream", "gefen-x"]
    assert not {colour_of(n) for n in ours} & {colour_of(n) for n in theirs}
    assert all("(ours)" in label_of(n) for n in ours)
    assert all("ours" not in label_of(n) for n in theirs)
    assert "published" in label_of("Gefen-8bit") and "published" in label_of("gefen-upstream")
    assert "Gefen-X" in label_of("dropin/gefen-x@0.6") and "0.6" in label_of("dropin/gefen-x@0.6")
    assert len(set(LABELS[n] for n in ours + theirs)) == len(ours + theirs)
