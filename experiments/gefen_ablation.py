"""Where Gefen's loss gap to AdamW comes from: a per-element second moment on one kind of tensor.

    python experiments/gefen_ablation.py            # two models and corpora, 3 seeds -> results/gefen_ablation.csv
    python experiments/gefen_ablation.py --quick    # 5 variants, 1 seed, the quick model -> results/quick/
    python analysis/gefen_ablation.py
    # which tensors carry the gap left by the factored second moment, on the larger model
    python experiments/gefen_ablation.py --sizes large --on-factored --variants none attn_qkv mlp_in
    # the same on the encoder built from torch's nn.TransformerEncoderLayer, at AdamW's 300-step lr there
    python experiments/gefen_ablation.py --sizes encoder --steps 300 --lr 8e-3 --on-factored --variants factored attn_qkv
    # the two architectures Gefen was not developed on, on top of the factor, at AdamW's best lr of each
    python experiments/gefen_ablation.py --experiment gefen_ablation_arch   # -> results/gefen_ablation_arch.csv
    python analysis/gefen_ablation_arch.py
    # does the factored 8-bit's gap grow with training: the encoder 3,000 steps, 5 seeds, lr fixed
    python experiments/gefen_ablation.py --experiment gefen_ablation_long   # -> results/gefen_ablation_long.csv
    python analysis/gefen_ablation_long.py
    # the layout options that bring the bytes near Gefen-X's, for loss: the same runs, one option each
    python experiments/gefen_ablation.py --experiment gefen_ablation_layout   # -> results/gefen_ablation_layout.csv
    python analysis/gefen_ablation_layout.py
    # one column factor a matrix against one per square tile, alone, the same runs
    python experiments/gefen_ablation.py --experiment gefen_ablation_column   # -> results/gefen_ablation_column.csv
    python analysis/gefen_ablation_column.py
    # 4-bit codes: the row-group scales of 2,048 and of 512 elements, alone and in the layout, 1,000 steps
    python experiments/gefen_ablation.py --experiment gefen_ablation_4bit   # -> results/gefen_ablation_4bit.csv
    python analysis/gefen_ablation_4bit.py
    # 4-bit codes with the codebook learned again every 100 steps, on the factor and under that layout
    python experiments/gefen_ablation.py --experiment gefen_ablation_refresh   # -> results/gefen_ablation_refresh.csv
    python analysis/gefen_ablation_refresh.py
    # 4-bit codes: the layout with a column factor per square tile, in fp32 and in bf16, against one a matrix
    python experiments/gefen_ablation.py --experiment gefen_ablation_factor16   # -> results/gefen_ablation_factor16.csv
    python analysis/gefen_ablation_factor16.py
    # 4-bit codes: the vectors' shared v and whole-row v, each alone on the factor, the same runs
    python experiments/gefen_ablation.py --experiment gefen_ablation_vectors4   # -> results/gefen_ablation_vectors4.csv
    python analysis/gefen_ablation_vectors4.py
    # 4-bit codes: row-group scales of 256 elements, alone and in the layout, its factor in fp32 and in bf16
    python experiments/gefen_ablation.py --experiment gefen_ablation_scales4   # -> results/gefen_ablation_scales4.csv
    python analysis/gefen_ablation_scales4.py
    # the encoder at 3,000 steps and AdamW's best lr there (8e-3): the first moment in fp32, the refresh, the layout
    python experiments/gefen_ablation.py --experiment gefen_ablation_long_best   # -> results/gefen_ablation_long_best.csv
    python analysis/gefen_ablation_long_best.py
    # 4-bit codes: the codebook learned again every 100 steps on the factor, on all five convergence models
    python experiments/gefen_ablation.py --experiment gefen_ablation_refresh_models   # -> its CSV
    python analysis/gefen_ablation_refresh_models.py
    # 4-bit codes: the layout of Gefen-4bit-compact with one of its four options left out at a time
    python experiments/gefen_ablation.py --experiment gefen_ablation_leave_out4   # -> its CSV
    python analysis/gefen_ablation_leave_out4.py
    # the drop-in protocol at 15 seeds, encoder and 116k GPT: factored 8-bit and 4-bit, gefen-x, AdamW
    python experiments/gefen_ablation.py --experiment gefen_ablation_seeds   # -> its CSV
    python analysis/gefen_ablation_seeds.py
    # the same runs of the factored 8-bit with its first moment in fp32
    python experiments/gefen_ablation.py --experiment gefen_ablation_seeds_fp32m   # -> its CSV
    python analysis/gefen_ablation_seeds_fp32m.py

Each variant is 8-bit Gefen (registry name Gefen-8bit) with ``share_second_moment=False`` (a
per-element v, as block length 1) on the named group of tensors only, through a second parameter
group, everything else unchanged; ``none`` is Gefen as published, ``all`` shares v nowhere. The
model, data, schedule and sizes are experiments/convergence.py's (experiments/train.py's
``CHAR_LM`` and ``train_lm``), at one learning rate for every run (``--lr``), with the same
initialisation and batches per seed for every variant and for AdamW. ``factored`` is Gefen with
``factor_second_moment=True`` on every tensor (registry name Gefen-8bit-factored); with
``--on-factored`` every variant also runs on top of it (variant ``factored+<name>``: the named
tensors per element, the rest factored). Vectors (norm gains, biases) are no variant of the GPT's
full run: Gefen's block rule already gives each of them block length 1 there. Every ``CHAR_LM``
architecture has the same kinds of tensors under its own names (``PATTERNS``): the encoder's
``attn_qkv`` is ``nn.MultiheadAttention``'s fused ``in_proj_weight``, the Llama-style model's
``mlp_in`` its gate and up projections; ``vectors`` (every norm gain and bias) is a variant on
request, since the rule shares v inside some of them in those models. ``fp32_m`` is no kind of
tensor: the first moment in fp32 (``quantize_first_moment=False``) on every tensor, v unchanged, so
``factored+fp32_m`` is what the factor costs without the codebook. Peers (``--peers``: gefen-x at its
defaults, or Gefen-4bit-factored) train beside AdamW at the same lr and report the same ratios.

The full run ablates two configurations (``--sizes``, ``CHAR_LM`` names): ``full`` (convergence.py's
116k model on documentation plus code, every variant) and ``docstrings`` (a 429k model on English
prose, 1,000 steps, every variant and every variant on top of the factored second moment). Rows of
the first configuration carry the variant name, those of the others ``<model label>/<variant>``
(convergence.py's labels). ``--jobs`` runs that many single-threaded runs at a time.

``--experiment gefen_ablation_arch`` (``ARCH_ABLATION``) ablates the factor on the ``encoder`` and
``llama`` configurations of convergence.py's architecture experiments, each at AdamW's best lr of
that experiment's grid (``DROPIN_LR``, the drop-in protocol), with gefen-x as a peer: Gefen as
published, v per element everywhere, the factor, and the factor with each kind of matrix per element
or the first moment in fp32 (vectors keep v per element under the factor already). With ``--quick``
or ``--tiny`` it runs that size in each architecture.

``--experiment gefen_ablation_long`` (``LONG_ABLATION``) trains the encoder 3,000 steps, 5 seeds, at
the 1,000-step lr held fixed (4e-3, AdamW's best there), gefen-x beside it: the factor alone and the
factor with its first moment's codes rounded stochastically (``sr_m``, no kind of tensor:
``first_moment_rounding="stochastic"`` on every tensor), to see whether that holds a gap that grows
with training; ``--experiment gefen_ablation_long_best`` (``LONG_BEST_ABLATION``) makes them at
AdamW's best lr at 3,000 steps (8e-3, convergence_long's) with the factor alone, the first moment in
fp32 (``fp32_m``), the codebook learned again (``refresh``) and ``layout`` (below), each on the
factor. ``--experiment gefen_ablation_layout`` (``LAYOUT_ABLATION``) makes the same runs with
the layout options that cut the factored state's bytes on top of the factor (gefen-x at these
settings is in gefen_ablation_long's file, whose seeds these are): ``layout``, all four together,
and ``scale_rows`` alone, the one that coarsens the first moment's quantisation. The options (each
also a variant on request): ``vec_v``, the vectors share v in the published rule's blocks, or in one
block where it finds none, and hold no factor (``share_vector_second_moment``), where under the
factor alone they keep v per element; ``rows_v``, a matrix in which the rule finds no block shares v
over whole rows (``share_matrix_rows``), where it keeps one per element; ``scale_rows``, a matrix
keeps one first-moment scale per group of whole rows of up to 2,048 elements
(``row_group_scales``), not one per row; ``whole_w``, one column factor per matrix
(``whole_matrix_factor``), not one per square tile of rows. ``--experiment gefen_ablation_column``
(``COLUMN_ABLATION``) makes the same runs with ``whole_w`` alone, ``--experiment gefen_ablation_vectors``
(``VECTOR_ABLATION``) with ``vec_v`` and ``rows_v``, each alone. ``--bits 4`` runs every variant with
4-bit codes (registry name Gefen-4bit); ``--experiment gefen_ablation_4bit`` (``FOUR_BIT_ABLATION``)
does so on the encoder at 1,000 steps with ``scale_rows`` and ``layout``, and ``scale_rows512`` and
``layout512``, the same with groups of at most 512 elements (``row_group_scales=512``).
``refresh`` (a variant on request, no kind of tensor) learns the codebook again every
``REFRESH_EVERY`` steps from that step's gradients (``codebook_refresh_every``);
``layout_refresh`` and ``layout512_refresh`` do so under each layout; ``--experiment
gefen_ablation_refresh`` (``REFRESH_ABLATION``) makes FOUR_BIT_ABLATION's runs with the factor and
``layout512``, each without and with ``refresh``. ``w16`` keeps the column factors in bf16, rounded
stochastically (``factor_dtype="bfloat16"``); ``layout512_tiles`` is ``layout512`` with a column
factor per square tile of rows instead of one a matrix, ``layout512_w16`` the same in bf16 (the
bytes of one a matrix or fewer at widths of 128 and more); ``--experiment gefen_ablation_factor16``
(``FACTOR16_ABLATION``) makes FOUR_BIT_ABLATION's runs with the factor, ``w16``, ``layout512``,
``layout512_tiles`` and ``layout512_w16``; ``--experiment gefen_ablation_vectors4``
(``VECTORS4_ABLATION``) makes them with ``vec_v`` and ``rows_v``, each alone on the factor;
``--experiment gefen_ablation_scales4`` (``SCALES4_ABLATION``) makes them with ``layout512``,
``scale_rows256``, ``layout256`` (``layout512`` with groups of at most 256 elements) and
``layout256_w16`` (the same with its one column factor a matrix in bf16, at fewer bytes than
``layout512`` at widths of 128 and more). ``--experiment gefen_ablation_refresh_models``
(``REFRESH_MODELS_ABLATION``) makes the factor with and without ``refresh`` under 4-bit codes on each
of convergence.py's five configurations (116k, 1.27M, 429k prose, encoder, Llama-style), at its own
steps and AdamW's best lr there (``DROPIN_LR``), 5 seeds each. ``layout512_no_<option>`` is
``layout512`` with one of its options (``vec_v``, ``rows_v``, ``scale_rows``, ``whole_w``) left out;
``--experiment gefen_ablation_leave_out4`` (``LEAVE_OUT4_ABLATION``) makes FOUR_BIT_ABLATION's runs
with the factor, ``layout512`` and each of the four. ``--experiment gefen_ablation_seeds``
(``SEEDS_ABLATION``) trains the encoder and the 116k GPT (``full``) at their steps and AdamW's best
lr there (the convergence runs' drop-in protocol) on 15 seeds, the first of them the convergence
runs': AdamW, the factored 8-bit, and as peers the registry's Gefen-4bit-factored and gefen-x;
``--experiment gefen_ablation_seeds_fp32m`` (``SEEDS_FP32_ABLATION``) makes the same runs of the
factored 8-bit without and with ``fp32_m``.

Rows: ``val_loss`` per variant (and AdamW) and seed, ``val_loss_vs_adamw`` (paired by seed), its
``_mean`` and ``_std``, and ``delta_vs_shared`` (the paired difference of ratios against ``none``),
its ``_mean`` and ``_std``; all against ``steps``.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

import argparse
import re
import statistics

import torch

from experiments.common import Results, add_common_args
from experiments.models import char_lm_model
from experiments.pool import RunPool
from experiments.registry import make_optimizer, state_bytes
from optim.gefen.layout import layout_of
from experiments.tracking import Run, Tracking, curve_summary, live_logger
from experiments.train import CHAR_LM, GRAD_CLIP, WEIGHT_DECAY, char_lm_label, char_lm_problem, train_lm

# variant -> regular expression of the parameter names (of experiments/models.py's GPT) that get a
# per-element v (None: no tensor). Names select the tensors of the ablation only; the optimizer
# never sees them.
VARIANTS = {
    "none": None,
    "all": r".",
    "embedding": r"^(wte|wpe)\.weight$",
    "lm_head": r"^lm_head\.weight$",
    "attn_qkv": r"attn\.[qkv]_proj\.weight$",
    "attn_out": r"attn\.o_proj\.weight$",
    "mlp_in": r"mlp\.fc\.weight$",
    "mlp_out": r"mlp\.proj\.weight$",
}
# the same kinds of tensors in every architecture of experiments/models.py, and its vectors
PATTERNS = {
    "gpt": dict(VARIANTS, vectors=r"(bias|ln_\d\.weight|ln_f\.weight)$"),
    "encoder": {
        "none": None,
        "all": r".",
        "embedding": r"^(tok\.weight|pos)$",
        "lm_head": r"^head\.weight$",
        "attn_qkv": r"self_attn\.in_proj_weight$",
        "attn_out": r"self_attn\.out_proj\.weight$",
        "mlp_in": r"linear1\.weight$",
        "mlp_out": r"linear2\.weight$",
        "vectors": r"(bias|norm\d?\.weight)$",
    },
    "llama": {
        "none": None,
        "all": r".",
        "embedding": r"^embed_tokens\.weight$",
        "lm_head": r"^lm_head\.weight$",
        "attn_qkv": r"self_attn\.[qkv]_proj\.weight$",
        "attn_out": r"self_attn\.o_proj\.weight$",
        "mlp_in": r"mlp\.(gate|up)_proj\.weight$",
        "mlp_out": r"mlp\.down_proj\.weight$",
        "vectors": r"norm\.weight$",
    },
}
FACTORED = "factored"  # every tensor shared and factored, none per element
FIRST_MOMENT = "fp32_m"  # the first moment in fp32 on every tensor (not a kind of tensor)
CODE_ROUNDING = "sr_m"  # the first moment's codes rounded stochastically on every tensor (not a kind of tensor)
VECTOR_BLOCKS = "vec_v"  # under the factor, the vectors share v by the published rule, else in one block
ROW_BLOCKS = "rows_v"  # under the factor, a matrix the rule finds no block in shares v over whole rows
ROW_SCALES = "scale_rows"  # under the factor, one first-moment scale per group of rows (up to 2,048 elements)
WHOLE_FACTOR = "whole_w"  # under the factor, one column factor a matrix, not one per square tile of rows
# the compact layout's fields beyond the factored one, by code width (group options of CHANGES)
COMPACT, COMPACT_4BIT = ({k: v for k, v in layout_of("compact", bits).fields().items()
                          if v != layout_of("factored", bits).fields()[k]} for bits in (8, 4))
LAYOUT = "layout"  # the four above together (COMPACT, Gefen-8bit-compact): Gefen-X's bytes or fewer
SHORT_GROUP = COMPACT_4BIT["row_group_scales"]  # elements: the short row-group scales (4-bit codes' 16 levels)
ROW_SCALES_SHORT = f"scale_rows{SHORT_GROUP}"  # row-group scales of at most SHORT_GROUP elements
LAYOUT_SHORT = f"layout{SHORT_GROUP}"  # the layout with those scales (COMPACT_4BIT, Gefen-4bit-compact)
REFRESH_EVERY = 100  # steps between codebook refreshes (codebook_refresh_every)
REFRESH = "refresh"  # the codebook learned again every REFRESH_EVERY steps (not a kind of tensor)
FACTOR16 = "w16"  # the column factors in bf16, rounded stochastically (not a kind of tensor)
LAYOUT_TILES = f"{LAYOUT_SHORT}_tiles"  # LAYOUT_SHORT with a column factor per square tile, not one a matrix
LAYOUT_W16 = f"{LAYOUT_SHORT}_{FACTOR16}"  # the same with the factors in bf16
FINE_GROUP = 256  # elements: finer row-group scales than SHORT_GROUP, paid for by bf16 factors
ROW_SCALES_FINE = f"scale_rows{FINE_GROUP}"  # row-group scales of at most FINE_GROUP elements
LAYOUT_FINE = f"layout{FINE_GROUP}"  # the 4-bit layout with those scales
LAYOUT_FINE_W16 = f"{LAYOUT_FINE}_{FACTOR16}"  # the same with its one column factor a matrix in bf16
# the layout's four options by variant, as Gefen's keywords
LAYOUT_OPTIONS = {VECTOR_BLOCKS: "share_vector_second_moment", ROW_BLOCKS: "share_matrix_rows",
                  ROW_SCALES: "row_group_scales", WHOLE_FACTOR: "whole_matrix_factor"}
# the 4-bit layout with one option left out (the other three together): <LAYOUT_SHORT>_no_<option>
LAYOUT_WITHOUT = {f"{LAYOUT_SHORT}_no_{v}": {k: x for k, x in COMPACT_4BIT.items() if k != key}
                  for v, key in LAYOUT_OPTIONS.items()}
# variants that are no kind of tensor: a Gefen option on every tensor
CHANGES = {FIRST_MOMENT: dict(quantize_first_moment=False), CODE_ROUNDING: dict(first_moment_rounding="stochastic"),
           VECTOR_BLOCKS: dict(share_vector_second_moment=True), ROW_BLOCKS: dict(share_matrix_rows=True),
           ROW_SCALES: dict(row_group_scales=True), WHOLE_FACTOR: dict(whole_matrix_factor=True), LAYOUT: COMPACT,
           ROW_SCALES_SHORT: dict(row_group_scales=SHORT_GROUP), LAYOUT_SHORT: COMPACT_4BIT,
           REFRESH: dict(codebook_refresh_every=REFRESH_EVERY),
           f"{LAYOUT}_{REFRESH}": dict(COMPACT, codebook_refresh_every=REFRESH_EVERY),
           f"{LAYOUT_SHORT}_{REFRESH}": dict(COMPACT_4BIT, codebook_refresh_every=REFRESH_EVERY),
           FACTOR16: dict(factor_dtype="bfloat16"), LAYOUT_TILES: dict(COMPACT_4BIT, whole_matrix_factor=False),
           LAYOUT_W16: dict(COMPACT_4BIT, whole_matrix_factor=False, factor_dtype="bfloat16"),
           ROW_SCALES_FINE: dict(row_group_scales=FINE_GROUP),
           LAYOUT_FINE: dict(COMPACT_4BIT, row_group_scales=FINE_GROUP),
           LAYOUT_FINE_W16: dict(COMPACT_4BIT, row_group_scales=FINE_GROUP, factor_dtype="bfloat16"),
           **LAYOUT_WITHOUT}
# options of CHANGES that are one per optimizer: the constructor's, in no group
OPTIMIZER_WIDE = ("codebook_refresh_every",)
UNDER_FACTOR = (VECTOR_BLOCKS, ROW_BLOCKS, ROW_SCALES, WHOLE_FACTOR, LAYOUT, ROW_SCALES_SHORT,
                LAYOUT_SHORT, f"{LAYOUT}_{REFRESH}", f"{LAYOUT_SHORT}_{REFRESH}", FACTOR16, LAYOUT_TILES,
                LAYOUT_W16, ROW_SCALES_FINE, LAYOUT_FINE, LAYOUT_FINE_W16,
                *LAYOUT_WITHOUT)  # changes that act under the factor only
# other optimizers that may train beside AdamW (registry names): Gefen-X, and our 4-bit factored Gefen
# beside an 8-bit ablation
PEERS = ("gefen-x", "Gefen-4bit-factored")
QUICK_VARIANTS = ["none", "all", "attn_qkv", "embedding", FACTORED]
FULL_SIZES = ["full", "docstrings"]
ON_FACTORED = {"docstrings"}  # sizes whose full run also ablates on top of the factored second moment
# AdamW's best lr on the grid of each configuration's convergence run (the committed runs of convergence.py,
# --experiment convergence_<arch> for the encoder and Llama-style models): the drop-in protocol's lr
DROPIN_LR = {"full": 3e-3, "large": 1e-3, "docstrings": 3e-3, "encoder": 4e-3, "llama": 2e-3}
ARCH_ABLATION = dict(sizes=["encoder", "llama"], seeds=3, peers=["gefen-x"], on_factored=True,
                     variants=["none", "all", FACTORED, "embedding", "lm_head", "attn_qkv", "attn_out", "mlp_in",
                               "mlp_out", FIRST_MOMENT])
# does the factored 8-bit's gap grow with training, and what holds it: the encoder 3x as long as the
# architecture experiments, at their 1,000-step lr (AdamW's best there) held fixed
LONG_ABLATION = dict(sizes=["encoder"], steps=3000, seeds=5, peers=["gefen-x"], lr=4e-3,
                     variants=[FACTORED, f"{FACTORED}+{CODE_ROUNDING}"])
# the same at AdamW's best lr at 3,000 steps (convergence_long's), with the first moment in fp32, the
# codebook learned again every REFRESH_EVERY steps (a codebook learned at step 1 may fit later steps' m less
# well) and the compact layout (Gefen-X's bytes or fewer), each on the factor
LONG_BEST_ABLATION = dict(LONG_ABLATION, lr=8e-3,
                          variants=[FACTORED, *(f"{FACTORED}+{v}" for v in (FIRST_MOMENT, REFRESH, LAYOUT))])
# the options that cut the factored state's bytes, for loss: LONG_ABLATION's runs, the four together and
# the one that coarsens the first moment's quantisation on its own
LAYOUT_ABLATION = dict(LONG_ABLATION, peers=[], variants=[FACTORED, f"{FACTORED}+{LAYOUT}", f"{FACTORED}+{ROW_SCALES}"])
# one column factor a matrix (Gefen-X's, Adafactor's) against one per square tile of rows, alone
COLUMN_ABLATION = dict(LONG_ABLATION, peers=[], variants=[FACTORED, f"{FACTORED}+{WHOLE_FACTOR}"])
# the two options that share v where the factor keeps it per element (vectors; matrices with no rule block), each alone
VECTOR_ABLATION = dict(LONG_ABLATION, peers=[],
                       variants=[FACTORED, f"{FACTORED}+{VECTOR_BLOCKS}", f"{FACTORED}+{ROW_BLOCKS}"])
# 4-bit codes under the layout: the factor, the row-group scales alone and in the layout, at 2,048 elements
# and at SHORT_GROUP, at the encoder's 1,000 steps and AdamW's best lr there (convergence_encoder's)
FOUR_BIT_ABLATION = dict(sizes=["encoder"], steps=1000, seeds=5, peers=[], lr=4e-3, bits=4,
                         variants=[FACTORED, *(f"{FACTORED}+{v}" for v in (ROW_SCALES, ROW_SCALES_SHORT, LAYOUT,
                                                                           LAYOUT_SHORT))])
# the codebook learned again every REFRESH_EVERY steps, under 4-bit codes: FOUR_BIT_ABLATION's runs, on the
# factor alone and under the layout of Gefen-4bit-compact
REFRESH_ABLATION = dict(FOUR_BIT_ABLATION, variants=[FACTORED, f"{FACTORED}+{REFRESH}", f"{FACTORED}+{LAYOUT_SHORT}",
                                                     f"{FACTORED}+{LAYOUT_SHORT}_{REFRESH}"])
# the column factor per square tile under 4-bit codes and the layout, in fp32 and in bf16: FOUR_BIT_ABLATION's runs
FACTOR16_ABLATION = dict(FOUR_BIT_ABLATION, variants=[FACTORED, *(f"{FACTORED}+{v}" for v in (FACTOR16, LAYOUT_SHORT,
                                                                                            LAYOUT_TILES, LAYOUT_W16))])
# which options of the 4-bit layout together carry its gap over the factor, where each alone is level with it:
# the layout with one option left out at a time, FOUR_BIT_ABLATION's runs
LEAVE_OUT4_ABLATION = dict(FOUR_BIT_ABLATION, variants=[FACTORED, f"{FACTORED}+{LAYOUT_SHORT}",
                                                        *(f"{FACTORED}+{v}" for v in LAYOUT_WITHOUT)])
# the drop-in protocol at 15 seeds on the two configurations whose factored 8-bit misses +0.3% there (the
# encoder, the 116k GPT; their convergence runs' 5 and 3 seeds first): the factored 8-bit, the factored 4-bit
# (registry name, as a peer) and gefen-x against AdamW, to judge +0.3% / +0.6% targets whose paired error
# at 3 to 5 seeds is about as large
SEEDS_ABLATION = dict(sizes=["encoder", "full"], seeds=15, peers=["gefen-x", "Gefen-4bit-factored"],
                      variants=[FACTORED])
# the same runs of the factored 8-bit with its first moment in fp32: what the codes cost there, and the factor
SEEDS_FP32_ABLATION = dict(SEEDS_ABLATION, peers=[], variants=[FACTORED, f"{FACTORED}+{FIRST_MOMENT}"])
# the codebook learned again under 4-bit codes on the factor, on every convergence configuration at its
# own steps and AdamW's best lr there (DROPIN_LR): does REFRESH_ABLATION's gain on the encoder hold elsewhere
REFRESH_MODELS_ABLATION = dict(sizes=list(DROPIN_LR), seeds=5, peers=[], bits=4,
                               variants=[FACTORED, f"{FACTORED}+{REFRESH}"])
# the two options that share v where the factor keeps it per element, each alone under 4-bit codes
VECTORS4_ABLATION = dict(FOUR_BIT_ABLATION, variants=[FACTORED, f"{FACTORED}+{VECTOR_BLOCKS}", f"{FACTORED}+{ROW_BLOCKS}"])
# row-group scales of FINE_GROUP elements under 4-bit codes, alone and in the layout, with the layout's
# factor in fp32 and in bf16 (the bf16 factor pays for the finer scales' bytes): FOUR_BIT_ABLATION's runs
SCALES4_ABLATION = dict(FOUR_BIT_ABLATION, variants=[
    FACTORED, *(f"{FACTORED}+{v}" for v in (LAYOUT_SHORT, ROW_SCALES_FINE, LAYOUT_FINE, LAYOUT_FINE_W16))])
EXPERIMENTS = ("gefen_ablation", "gefen_ablation_arch", "gefen_ablation_long", "gefen_ablation_layout",
               "gefen_ablation_column", "gefen_ablation_vectors", "gefen_ablation_4bit", "gefen_ablation_refresh",
               "gefen_ablation_factor16", "gefen_ablation_vectors4", "gefen_ablation_scales4",
               "gefen_ablation_long_best", "gefen_ablation_refresh_models", "gefen_ablation_leave_out4",
               "gefen_ablation_seeds", "gefen_ablation_seeds_fp32m")
SETTINGS = {"gefen_ablation_arch": ARCH_ABLATION, "gefen_ablation_long": LONG_ABLATION,
            "gefen_ablation_layout": LAYOUT_ABLATION, "gefen_ablation_column": COLUMN_ABLATION,
            "gefen_ablation_vectors": VECTOR_ABLATION, "gefen_ablation_4bit": FOUR_BIT_ABLATION,
            "gefen_ablation_refresh": REFRESH_ABLATION, "gefen_ablation_factor16": FACTOR16_ABLATION,
            "gefen_ablation_vectors4": VECTORS4_ABLATION, "gefen_ablation_scales4": SCALES4_ABLATION,
            "gefen_ablation_long_best": LONG_BEST_ABLATION, "gefen_ablation_refresh_models": REFRESH_MODELS_ABLATION,
            "gefen_ablation_leave_out4": LEAVE_OUT4_ABLATION, "gefen_ablation_seeds": SEEDS_ABLATION,
            "gefen_ablation_seeds_fp32m": SEEDS_FP32_ABLATION}
ON_TOP_ONLY = tuple(SETTINGS)[1:]  # the factor and changes on top of it, nothing else


def per_element_v_groups(model, pattern, factored=False, **every):
    """Param groups: the tensors matching ``pattern`` with ``share_second_moment=False``, the rest
    with ``factor_second_moment=factored``; ``every`` (Gefen options) in both groups."""
    rx = re.compile(pattern) if pattern else None
    own = [p for n, p in model.named_parameters() if rx is not None and rx.search(n)]
    rest = [p for n, p in model.named_parameters() if rx is None or not rx.search(n)]
    return [g for g in ({"params": rest, "factor_second_moment": factored, **every},
                        {"params": own, "share_second_moment": False, **every}) if g["params"]]


def variant_groups(model, variant: str, arch: str = "gpt"):
    """Param groups of one Gefen ``variant`` (``[factored+]<kind>``, ``factored``, ``[factored+]<change>``
    of ``CHANGES``), without the change's ``variant_options``."""
    own = variant.removeprefix(f"{FACTORED}+")
    factored = variant.startswith(FACTORED)
    if own in CHANGES:
        every = {k: v for k, v in CHANGES[own].items() if k not in OPTIMIZER_WIDE}
        return per_element_v_groups(model, None, factored, **every)
    return per_element_v_groups(model, None if own == FACTORED else PATTERNS[arch][own], factored)


def variant_options(variant: str) -> dict:
    """The optimizer-wide options of one Gefen ``variant``'s change (``OPTIMIZER_WIDE``), for its layout."""
    change = CHANGES.get(variant.removeprefix(f"{FACTORED}+"), {})
    return {k: v for k, v in change.items() if k in OPTIMIZER_WIDE}


def final_loss(size: dict, variant: str | None, seed: int, lr: float, tracking: Tracking | None = None,
               bits: int = 8) -> float:
    """Final validation loss of one run: AdamW (``variant`` None), a peer (a registry name of
    ``PEERS``) or ``bits``-bit Gefen with the variant's tensors per element (and the rest factored for
    ``factored...``). The problem is built once per process. With ``tracking``, the run is its own
    W&B run (optimizer "Gefen-<bits>bit[<variant>]" for an ablation variant), its curves logged at the
    size's evaluation interval."""
    cfg, corpus, n_params = char_lm_problem(size)
    torch.manual_seed(seed)
    model = char_lm_model(cfg)
    if variant is None or variant in PEERS:
        name = variant or "AdamW"
        opt = make_optimizer(name, model, lr, WEIGHT_DECAY)
    else:
        name = f"Gefen-{bits}bit[{variant}]"
        groups = variant_groups(model, variant, size.get("arch", "gpt"))
        opt = make_optimizer(f"Gefen-{bits}bit", groups, lr, WEIGHT_DECAY,
                             layout=layout_of("published", bits).replace(**variant_options(variant)))
    run = tracking.train_run(model=char_lm_label(size), optimizer=name, lr=lr, seed=seed, config=dict(
        {k: v for k, v in size.items() if k not in ("lrs", "seeds")}, model=vars(cfg), params=n_params,
        variant=variant or "AdamW", bits=bits, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP)) if tracking else Run()
    with run:
        out = train_lm(model, opt, corpus[0], corpus[1], lr=lr, steps=size["steps"], batch=size["batch"], seed=seed,
                       eval_every=size["eval_every"], on_eval=live_logger(run, lambda: {"state/bytes": state_bytes(opt)}))
        run.summary(curve_summary(out["val"], out["train"], out["step_times"],
                                  extra={"params": n_params, "wall_seconds": out["wall"]}))
    return out["final"]


def variants_of(size_name: str, args) -> list[str]:
    """The variants one configuration runs: ``none`` first; with ``--on-factored`` (or a size of
    ``ON_FACTORED`` in the full run) every per-element variant again on top of the factor."""
    names = list(args.variants or (QUICK_VARIANTS if args.quick else [*VARIANTS, FACTORED]))
    if "none" not in names:
        names = ["none"] + names
    if args.on_factored or (args.variants is None and not args.quick and size_name in ON_FACTORED):
        names += [f"{FACTORED}+{v}" for v in names if v not in (FACTORED, "none", "all") and "+" not in v]
    if args.experiment == "gefen_ablation_arch":  # on top of the factor only: the published Gefen's rule is "none"
        names = [v for v in names if v in ("none", "all", FACTORED) or "+" in v]
    if args.experiment in ON_TOP_ONLY:
        names = [v for v in names if v == FACTORED or v.startswith(f"{FACTORED}+")]
    return list(args.peers) + names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--experiment", default=EXPERIMENTS[0], choices=EXPERIMENTS,
                        help="results file name; every name but gefen_ablation runs its SETTINGS' defaults "
                             "(module docstring)")
    parser.add_argument("--tiny", action="store_true", help="test size (seconds)")
    kinds = [*PATTERNS["gpt"], *CHANGES]
    parser.add_argument("--variants", nargs="+", default=None,
                        choices=[*(v for v in kinds if v not in UNDER_FACTOR), FACTORED,
                                 *(f"{FACTORED}+{v}" for v in kinds if v not in ("none", "all"))],
                        help="default: all (--quick: " + ", ".join(QUICK_VARIANTS) + ")")
    parser.add_argument("--seeds", type=int, default=None, help="default: the size's seeds (3 full, 1 quick)")
    parser.add_argument("--steps", type=int, default=None, help="default: the size's steps")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate of every run (default 3e-3; an experiment's: DROPIN_LR per size)")
    parser.add_argument("--peers", nargs="*", default=None, choices=PEERS,
                        help="optimizers trained beside AdamW at the same lr (default: none; gefen_ablation_arch: "
                             "gefen-x)")
    parser.add_argument("--sizes", "--size", nargs="+", default=None, choices=list(CHAR_LM),
                        help=f"CHAR_LM sizes to ablate (default: {' '.join(FULL_SIZES)}; --quick: quick)")
    parser.add_argument("--on-factored", action="store_true",
                        help="also run every variant on top of the factored second moment (the full run "
                             f"does so on {', '.join(sorted(ON_FACTORED))})")
    parser.add_argument("--bits", type=int, default=None, choices=(8, 4),
                        help="the first moment's code width of every Gefen variant (default 8)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="single-threaded runs at a time (default: 2 for the full run, 1 otherwise)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    full = not (args.tiny or args.quick)
    small = "tiny" if args.tiny else "quick"
    settings = SETTINGS.get(args.experiment)
    arch = settings is not None
    if arch:  # the experiment's settings; a quick or tiny run keeps its size's one seed and steps
        for key, value in settings.items():
            if key != "sizes" and (full or key not in ("seeds", "steps")) and getattr(args, key) in (None, False):
                setattr(args, key, value)
    args.peers = args.peers or []
    args.bits = args.bits or 8
    size_names = args.sizes or (settings["sizes"] if arch else FULL_SIZES if full else [small])
    if arch and not full and args.sizes is None:  # the test or quick size once in each architecture
        first = {}
        for name in size_names:
            first.setdefault(CHAR_LM[name].get("arch", "gpt"), name)
        size_names = list(first.values())
    jobs = args.jobs or (2 if full else 1)
    configs = []
    for k, name in enumerate(size_names):
        size = dict(CHAR_LM[name])
        if arch and not full and args.sizes is None:  # the test or quick size in that architecture
            size = dict(CHAR_LM[small], arch=size.get("arch", "gpt"))
        size["steps"] = args.steps or size["steps"]
        cfg, corpus, n_params = char_lm_problem(size)
        label = char_lm_label(size)
        seeds = list(range(args.seed, args.seed + (args.seeds or size["seeds"])))
        variants = variants_of(name, args)
        lr = args.lr or (DROPIN_LR.get(name, 3e-3) if arch else 3e-3)
        configs.append((size, dict(size, size=name, label=label, prefix="" if k == 0 else label + "/", seeds=seeds,
                                   variants=variants, model=vars(cfg), params=n_params, lr=lr,
                                   patterns={v: PATTERNS[size.get("arch", "gpt")].get(v.removeprefix(f"{FACTORED}+"))
                                             for v in variants})))
    config = dict(vars(args), jobs=jobs, **configs[0][1], extra={c["label"]: c for _, c in configs[1:]})
    with Results(args.experiment, args, config=config) as res, RunPool(jobs) as pool:
        runs = [(c, {v: [pool.submit(final_loss, size, None if v == "AdamW" else v, s, c["lr"], res.tracking,
                                     args.bits)
                         for s in c["seeds"]]
                     for v in ["AdamW", *c["variants"]]}) for size, c in configs]
        for c, futs in runs:
            add_rows(res, c, {v: [f.result() for f in fs] for v, fs in futs.items()})


def add_rows(res, c, losses):
    """One configuration's rows from {variant or "AdamW": [final loss per seed]}."""
    x = dict(x_name="steps", x_value=c["steps"])
    base, p, ratios = losses["AdamW"], c["prefix"], {}
    for s, v in zip(c["seeds"], base):
        res.add(p + "AdamW", "val_loss", "nats/char", v, seed=s, **x)
    for name in c["variants"]:
        ratios[name] = [v / b for v, b in zip(losses[name], base)]
        for s, v, r in zip(c["seeds"], losses[name], ratios[name]):
            res.add(p + name, "val_loss", "nats/char", v, seed=s, **x)
            res.add(p + name, "val_loss_vs_adamw", "ratio", r, seed=s, **x)
        res.add(p + name, "val_loss_vs_adamw_mean", "ratio", statistics.fmean(ratios[name]), **x)
        res.add(p + name, "val_loss_vs_adamw_std", "ratio", _std(ratios[name]), **x)
        print(f"[gefen_ablation] {c['label']}: per-element v on {name}: {statistics.fmean(ratios[name]):.4f} "
              f"+- {_std(ratios[name]):.4f} x AdamW over {len(c['seeds'])} seeds", flush=True)
    for name in c["variants"] if "none" in ratios else []:
        deltas = [r - r0 for r, r0 in zip(ratios[name], ratios["none"])]
        res.add(p + name, "delta_vs_shared_mean", "ratio", statistics.fmean(deltas), **x)
        res.add(p + name, "delta_vs_shared_std", "ratio", _std(deltas), **x)
    res.flush()


def _std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


if __name__ == "__main__":
    main()
