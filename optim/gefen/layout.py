"""Gefen's state layouts: one frozen record of the options that decide what the state holds.

A ``GefenLayout``'s fields are plain values in every parameter group, under these names, which the
state (``state.py``), the step plan (``plan.py``) and the three backends read; a record only
builds them. Its defaults are the published algorithm (arXiv 2606.13894), and they are also what a
group saved before an option existed meant (``SAVED_BEFORE``). The named layouts are those the
measurements are about (results/README.md); an ablation is ``layout_of(name, bits).replace(...)``.
Each field is described in docs/USAGE.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .._checks import check_flags, check_option
from .checks import ROUNDINGS, check_refresh, check_row_group_scales
from .partition import RULES
from .state import FACTOR_DTYPES


@dataclass(frozen=True)
class GefenLayout:
    """Which state Gefen keeps; the defaults are the published algorithm (docs/USAGE.md, a section a field)."""

    share_second_moment: bool = True  # one v per block found by block_rule; False: one per element
    quantize_first_moment: bool = True  # m as bits-bit codes and block scales; False: m in fp32
    factor_second_moment: bool = False  # v per block times a column factor w (Adafactor's estimate)
    share_vector_second_moment: bool = False  # under the factor: a vector shares v, holds no w
    share_matrix_rows: bool = False  # under the factor: a matrix with no rule block shares v per row
    row_group_scales: bool | int = False  # under the factor: one m scale per group of rows (an int: its bound)
    whole_matrix_factor: bool = False  # under the factor: one w per matrix, not per square tile of rows
    factor_dtype: str = "float32"  # w's dtype: "float32" or "bfloat16"
    bound_first_moment: bool = False  # clip m^ to AdamW's bound on |m| / sqrt(v), v at the most the state allows
    first_moment_rounding: str = "nearest"  # codes rounded to "nearest" or "stochastic"ally
    codebook_refresh_every: int = 0  # learn the codebook again every this many steps (0: once); optimizer-wide
    block_rule: str = "adjacent_log"  # partition.py's rule, or "variance_drop"; optimizer-wide

    def __post_init__(self):
        check_flags(**{name: getattr(self, name) for name in FLAGS})
        check_row_group_scales(self.row_group_scales)
        check_option("factor_dtype", self.factor_dtype, tuple(FACTOR_DTYPES), f"one of {tuple(FACTOR_DTYPES)} (a string)")
        check_option("first_moment_rounding", self.first_moment_rounding, ROUNDINGS, f"one of {ROUNDINGS}")
        check_refresh(self.codebook_refresh_every, False)
        check_option("block_rule", self.block_rule, RULES, f"one of {RULES}")
        if self.first_moment_rounding == "stochastic" and not self.quantize_first_moment:
            raise ValueError("GefenLayout: first_moment_rounding='stochastic' with quantize_first_moment=False: "
                             "only codes are rounded, an fp32 first moment is not; set one of them otherwise")

    def replace(self, **changes) -> GefenLayout:
        """This layout with ``changes`` (fields by name), checked as a new record is."""
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise ValueError(f"GefenLayout has no field {', '.join(map(repr, unknown))}; its fields are {FIELDS}")
        return dataclasses.replace(self, **changes)

    def fields(self) -> dict:
        """{field: value}, as a parameter group holds them."""
        return {name: getattr(self, name) for name in FIELDS}


FIELDS = tuple(f.name for f in dataclasses.fields(GefenLayout))
FLAGS = ("share_second_moment", "quantize_first_moment", "factor_second_moment", "share_vector_second_moment",
         "share_matrix_rows", "whole_matrix_factor", "bound_first_moment")
# the value of each option in a group saved (or pickled) before the option existed: the published rule,
# minimizing, weights rounded to nearest
SAVED_BEFORE = {**GefenLayout().fields(), "maximize": False, "stochastic_rounding": False}

# the factored layout at Gefen-X's bytes or fewer: the vectors' v shared, whole-row v where the rule finds
# no block, one first-moment scale per group of rows
_COMPACT = dict(factor_second_moment=True, share_vector_second_moment=True, share_matrix_rows=True,
                row_group_scales=True, bound_first_moment=True)
LAYOUTS = {
    "published": {8: GefenLayout(), 4: GefenLayout()},  # the article's Gefen
    # AdamW's loss on 4 of 5 models; it and "compact" bound m^ by AdamW's own bound: the codebook has no
    # 0, so a zero or tiny m next to its scale block's largest is stored as the smallest entry, which a v
    # near 0 turns into steps of thousands of lr (an embedding row no batch touches)
    "factored": dict.fromkeys((8, 4), GefenLayout(factor_second_moment=True, bound_first_moment=True)),
    # at 8 bits a bf16 column factor per tile: less loss than one fp32 factor per matrix, in fewer bytes
    # (results/gefen_ablation_candidates.csv); 4-bit codes' 16 levels lose a row group's small m under one
    # scale of 2,048 elements: groups of at most 512 (results/gefen_ablation_4bit.csv), one fp32 factor
    # per matrix to keep 4 bytes a scale under Gefen-X's state
    "compact": {8: GefenLayout(**_COMPACT, factor_dtype="bfloat16"),
                4: GefenLayout(**dict(_COMPACT, row_group_scales=512, whole_matrix_factor=True))},
    "adamw": dict.fromkeys((8, 4), GefenLayout(share_second_moment=False, quantize_first_moment=False)),
}


def layout_of(layout: str | GefenLayout, bits: int = 8) -> GefenLayout:
    """The record of a named layout at ``bits`` (8 or 4), or ``layout`` itself where it is a record."""
    if isinstance(layout, GefenLayout):
        return layout
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"Gefen: unknown layout {layout!r}; give one of {tuple(LAYOUTS)} or a GefenLayout record")
    check_option("bits", bits, (8, 4), "8 or 4 (an int)")
    return LAYOUTS[layout][bits]
