"""Gefen ablations: which part of the state carries the loss gap to AdamW, and what each layout option costs.

    python experiments/gefen_ablation.py --ablation NAME            # one row of ABLATIONS -> results/NAME.csv
    python experiments/gefen_ablation.py --ablation NAME --quick    # its variants on the quick model, 1 seed -> results/quick/
    python analysis/gefen_ablation.py                               # every ablation's CSV -> results/ablations.md
    # an ablation of your own: the 1.27M model, per-element v on two kinds of tensor, also on top of the factor
    python experiments/gefen_ablation.py --sizes large --on-factored --variants none attn_qkv mlp_in

An ablation is one row of ``ABLATIONS``: its models (``CHAR_LM`` configurations of
experiments/harness/train.py), steps, seeds, lr (a number, or None: the drop-in protocol, AdamW's best lr of
each model's convergence run, ``DROPIN_LR``), code width, peers and variants. A variant is one Gefen
layout record (``optim.gefen.layout.GefenLayout``, ``variant_layout``) and, for a kind of tensor, the
tensors that keep v per element (``PATTERNS``):

- ``none``: Gefen as published; ``factored``: the factored layout (``layout_of("factored", bits)``);
- a kind of tensor (``all``, ``embedding``, ``lm_head``, ``attn_qkv``, ``attn_out``, ``mlp_in``,
  ``mlp_out``, ``vectors``): a second parameter group of those tensors with ``share_second_moment=False``
  (block length 1), the rest as the layout says; ``factored+<kind>``: the same on the factored layout;
- ``[factored+]<change>`` of ``CHANGES``: the layout with those fields replaced on every tensor
  (``fp32_m``: the first moment in fp32; ``layout``: the compact layout's four options; ...).

Peers (registry names, ``PEERS``) train beside AdamW at the same lr and seeds. Every run of one seed
starts from the same initialisation and sees the same batches. Each configuration after an
ablation's first writes its rows as ``<model label>/<variant>``. ``--quick`` and ``--tiny`` run that
size once in each architecture of the ablation, at its seed and steps. ``--jobs`` runs that many
single-threaded runs at a time. Each finished run is journaled (``results/partial/<ablation>.jsonl``,
``harness.journal``): a run stopped part way and started again with the same code, configuration,
versions and CPU reuses the runs it finished; the journal goes once the CSV is written.

Rows: ``val_loss`` and ``state_bytes_per_param`` (the optimizer's state at the end of the run) per
variant (and AdamW) and seed, ``val_loss_vs_adamw`` (paired by seed), its ``_mean`` and ``_std``, and,
where ``none`` ran, ``delta_vs_shared`` (the paired difference of ratios against ``none``), its
``_mean`` and ``_std``; all against ``steps``.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import re
import statistics
from dataclasses import dataclass
from typing import NamedTuple

import torch

from experiments.harness import check
from experiments.harness.common import Results, add_common_args
from experiments.harness.models import char_lm_model
from experiments.harness.journal import Journal, host_cpu, journaled
from experiments.harness.pool import RunPool
from experiments.harness.registry import make_optimizer, state_bytes
from experiments.harness.tracking import Run, Tracking, curve_summary, live_logger
from experiments.harness.train import CHAR_LM, GRAD_CLIP, WEIGHT_DECAY, char_lm_label, char_lm_problem, train_lm
from optim.gefen.layout import GefenLayout, layout_of

# kind of tensor -> regular expression of the parameter names (of experiments/harness/models.py's GPT) that get a
# per-element v (None: no tensor). Names select the tensors of the ablation only; the optimizer never sees them.
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
# the same kinds of tensors in every architecture of experiments/harness/models.py, and its vectors
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
KINDS = [k for k in VARIANTS if k not in ("none", "all")]  # the kinds of matrices, one variant each
FACTORED = "factored"  # every tensor shared and factored, none per element
REFRESH_EVERY = 100  # steps between codebook refreshes (codebook_refresh_every)
SHORT_GROUP = layout_of("compact", 4).row_group_scales  # elements: the 4-bit compact layout's row-group scales
FINE_GROUP = 256  # elements: finer row-group scales than SHORT_GROUP, paid for by bf16 factors
# the compact layout's fields beyond the factored one as these ablations first measured it ("layout", and
# "layout512" at 4 bits): one fp32 column factor per matrix
COMPACT = dict(share_vector_second_moment=True, share_matrix_rows=True, row_group_scales=True,
               whole_matrix_factor=True)
COMPACT_4BIT = dict(COMPACT, row_group_scales=SHORT_GROUP)
COMPACT_W16 = dict(COMPACT, whole_matrix_factor=False, factor_dtype="bfloat16")  # a bf16 column factor per tile
BOUND = dict(bound_first_moment=True)  # m^ clipped to AdamW's bound on |m| / sqrt(v)
# by code width, the variant that is layout="compact" but for the first-moment bound (a bf16 column factor
# per tile at 8 bits): what the committed runs measured under that name
COMPACT_VARIANT = {8: "factored+layout_w16", 4: f"factored+layout{SHORT_GROUP}"}
# the factored layout as these ablations measured it, every variant's base: without the first-moment bound
# that layout="factored" has since (the variant "bound" adds it)
FACTORED_MEASURED = {bits: layout_of("factored", bits).replace(bound_first_moment=False) for bits in (8, 4)}
# the compact layout's four options by short name
LAYOUT_OPTIONS = {"vec_v": "share_vector_second_moment", "rows_v": "share_matrix_rows",
                  "scale_rows": "row_group_scales", "whole_w": "whole_matrix_factor"}
# changes: variants that are no kind of tensor, a layout's fields replaced on every tensor
CHANGES = {
    "fp32_m": dict(quantize_first_moment=False),  # the first moment in fp32
    "sr_m": dict(first_moment_rounding="stochastic"),  # its codes rounded stochastically
    "vec_v": dict(share_vector_second_moment=True),  # under the factor: the vectors share v, no w
    "rows_v": dict(share_matrix_rows=True),  # under the factor: v over whole rows where the rule finds no block
    "scale_rows": dict(row_group_scales=True),  # under the factor: one m scale per group of rows (<= 2,048)
    "whole_w": dict(whole_matrix_factor=True),  # under the factor: one column factor a matrix, not one a tile
    "layout": COMPACT,  # the four together: Gefen-8bit-compact
    f"scale_rows{SHORT_GROUP}": dict(row_group_scales=SHORT_GROUP),
    f"layout{SHORT_GROUP}": COMPACT_4BIT,  # Gefen-4bit-compact
    "refresh": dict(codebook_refresh_every=REFRESH_EVERY),  # the codebook learned again
    "layout_refresh": dict(COMPACT, codebook_refresh_every=REFRESH_EVERY),
    f"layout{SHORT_GROUP}_refresh": dict(COMPACT_4BIT, codebook_refresh_every=REFRESH_EVERY),
    "w16": dict(factor_dtype="bfloat16"),  # the column factors in bf16, rounded stochastically
    f"layout{SHORT_GROUP}_tiles": dict(COMPACT_4BIT, whole_matrix_factor=False),  # a column factor per tile
    f"layout{SHORT_GROUP}_w16": dict(COMPACT_4BIT, whole_matrix_factor=False, factor_dtype="bfloat16"),
    "layout_w16": COMPACT_W16,
    # the bound alone, and on the compact layouts (layout="compact" today)
    "bound": BOUND,
    "layout_w16_bound": dict(COMPACT_W16, **BOUND),
    f"layout{SHORT_GROUP}_bound": dict(COMPACT_4BIT, **BOUND),
    f"scale_rows{FINE_GROUP}": dict(row_group_scales=FINE_GROUP),
    f"layout{FINE_GROUP}": dict(COMPACT_4BIT, row_group_scales=FINE_GROUP),
    f"layout{FINE_GROUP}_w16": dict(COMPACT_4BIT, row_group_scales=FINE_GROUP, factor_dtype="bfloat16"),
    # the compact layout with one of its options left out, at 8 and at 4 bits
    **{f"layout_no_{short}": {k: x for k, x in COMPACT.items() if k != field}
       for short, field in LAYOUT_OPTIONS.items()},
    **{f"layout{SHORT_GROUP}_no_{short}": {k: x for k, x in COMPACT_4BIT.items() if k != field}
       for short, field in LAYOUT_OPTIONS.items()},
}
# changes that act under the factor only (a request for them on the published Gefen is refused)
UNDER_FACTOR = tuple(c for c, fields in CHANGES.items()
                     if set(fields) - {"quantize_first_moment", "first_moment_rounding", "codebook_refresh_every"})
# options of CHANGES that are one per optimizer: the constructor's, in no group
OPTIMIZER_WIDE = ("codebook_refresh_every",)
# other optimizers that may train beside AdamW (registry names): Gefen-X, and our 4-bit factored Gefen
PEERS = ("gefen-x", "Gefen-4bit-factored")
QUICK_VARIANTS = ("none", "all", "attn_qkv", "embedding", FACTORED)
# AdamW's best lr on the grid of each configuration's convergence run (the committed runs of convergence.py,
# --experiment convergence_<arch> for the encoder and Llama-style models): the drop-in protocol's lr
DROPIN_LR = {"full": 3e-3, "large": 1e-3, "docstrings": 3e-3, "encoder": 4e-3, "llama": 2e-3}


# the code a run executes: a full run reuses the runs its journal holds while this code is unchanged
JOURNAL_CODE = ("optim", "experiments/harness", "experiments/gefen_ablation.py")


def on_factor(*changes: str) -> tuple:
    """``factored`` and each change on top of it: ``("factored", "factored+<change>", ...)``."""
    return (FACTORED, *(f"{FACTORED}+{c}" for c in changes))


@dataclass(frozen=True)
class Ablation:
    """One ablation: ``results/<name>.csv``. ``sizes`` are ``CHAR_LM`` configurations; ``steps`` and
    ``seeds`` None are each size's own; ``lr`` None is the drop-in protocol (``DROPIN_LR``);
    ``on_factored`` sizes also run each kind of tensor on top of the factor."""

    name: str
    question: str  # what it asks, in the results page's words
    sizes: tuple
    variants: tuple
    steps: int | None = None
    seeds: int | None = None
    lr: float | None = None
    bits: int = 8
    peers: tuple = ()
    on_factored: tuple = ()

    def layouts(self) -> dict:
        """{variant: its Gefen layout record} (peers excluded)."""
        return {v: variant_layout(v, self.bits) for v in self.variants}


# compact layouts within Gefen-X's bytes that aim at the factored layout's loss, beside both
CANDIDATES = on_factor("layout", "layout_w16", f"layout{SHORT_GROUP}_w16")
LONG = dict(sizes=("encoder",), steps=3000, seeds=5, lr=4e-3)  # the encoder 3x as long, at its 1,000-step lr
FOUR = dict(sizes=("encoder",), steps=1000, seeds=5, lr=4e-3, bits=4)  # the encoder under 4-bit codes
SEEDS = dict(sizes=("encoder", "full"), seeds=15)  # the drop-in protocol on 15 seeds (the first the convergence runs')
ABLATIONS = {a.name: a for a in [
    Ablation("gefen_ablation", "where the published Gefen's gap comes from: v per element on one kind of tensor",
             ("full", "docstrings"), (*VARIANTS, FACTORED), lr=3e-3, on_factored=("docstrings",)),
    Ablation("gefen_ablation_arch", "what the factor leaves on the two architectures it was not developed on",
             ("encoder", "llama"), ("none", "all", *on_factor(*KINDS, "fp32_m")), seeds=3, peers=("gefen-x",)),
    Ablation("gefen_ablation_long", "does the factored 8-bit's gap grow with training (3,000 steps)",
             variants=on_factor("sr_m"), peers=("gefen-x",), **LONG),
    Ablation("gefen_ablation_long_best", "the same at AdamW's best lr at 3,000 steps, one change each",
             variants=on_factor("fp32_m", "refresh", "layout"), peers=("gefen-x",), **dict(LONG, lr=8e-3)),
    Ablation("gefen_ablation_layout", "the compact layout's options for loss: all four, and row-group scales alone",
             variants=on_factor("layout", "scale_rows"), **LONG),
    Ablation("gefen_ablation_column", "one column factor a matrix against one per square tile",
             variants=on_factor("whole_w"), **LONG),
    Ablation("gefen_ablation_vectors", "v shared on vectors, and over whole rows, each alone",
             variants=on_factor("vec_v", "rows_v"), **LONG),
    Ablation("gefen_ablation_4bit", "row-group scales under 4-bit codes, of 2,048 and of 512 elements",
             variants=on_factor("scale_rows", f"scale_rows{SHORT_GROUP}", "layout", f"layout{SHORT_GROUP}"), **FOUR),
    Ablation("gefen_ablation_refresh", "the codebook learned again under 4-bit codes, on the factor and the layout",
             variants=on_factor("refresh", f"layout{SHORT_GROUP}", f"layout{SHORT_GROUP}_refresh"), **FOUR),
    Ablation("gefen_ablation_factor16", "column factors per tile and in bf16 under 4-bit codes",
             variants=on_factor("w16", *(f"layout{SHORT_GROUP}{s}" for s in ("", "_tiles", "_w16"))), **FOUR),
    Ablation("gefen_ablation_vectors4", "v shared on vectors, and over whole rows, under 4-bit codes",
             variants=on_factor("vec_v", "rows_v"), **FOUR),
    Ablation("gefen_ablation_scales4", "row-group scales of 256 elements under 4-bit codes",
             variants=on_factor(f"layout{SHORT_GROUP}", f"scale_rows{FINE_GROUP}", f"layout{FINE_GROUP}",
                                f"layout{FINE_GROUP}_w16"), **FOUR),
    Ablation("gefen_ablation_leave_out4", "the 4-bit compact layout with one option left out",
             variants=on_factor(f"layout{SHORT_GROUP}", *(f"layout{SHORT_GROUP}_no_{o}" for o in LAYOUT_OPTIONS)),
             **FOUR),
    Ablation("gefen_ablation_refresh_models", "the codebook learned again under 4-bit codes on five models",
             tuple(DROPIN_LR), on_factor("refresh"), seeds=5, bits=4),
    Ablation("gefen_ablation_seeds", "the drop-in protocol on 15 seeds", variants=(FACTORED,),
             peers=("gefen-x", "Gefen-4bit-factored"), **SEEDS),
    Ablation("gefen_ablation_seeds_fp32m", "the factored 8-bit's first moment in fp32 on 15 seeds",
             variants=on_factor("fp32_m"), **SEEDS),
    # the vectors are left out: under the factor they keep v per element already (share_vector_second_moment)
    Ablation("gefen_ablation_where", "where the factored 8-bit's gap lives on the encoder: v per element on one "
             "kind of matrix at a time, 15 seeds", ("encoder",), on_factor(*KINDS), seeds=15),
    Ablation("gefen_ablation_leave_out", "which of the 8-bit compact layout's options costs loss on the encoder: "
             "each left out, 15 seeds", ("encoder",), on_factor("layout", *(f"layout_no_{o}" for o in LAYOUT_OPTIONS)),
             seeds=15),
    # one column factor a matrix is the option whose leaving out gains the most (gefen_ablation_leave_out);
    # a factor per tile in bf16 costs fewer bytes than one a matrix in fp32
    Ablation("gefen_ablation_candidates", "compact layouts with a bf16 column factor per tile (Gefen-X's bytes or "
             "fewer), 15 seeds", ("encoder",), CANDIDATES, seeds=15),
    Ablation("gefen_ablation_candidates_models", "the same candidates on the other four models, 5 seeds",
             tuple(s for s in DROPIN_LR if s != "encoder"), CANDIDATES, seeds=5),
    # m^ clipped to AdamW's bound (the factored and compact layouts since): what it does to the loss
    Ablation("gefen_ablation_bound", "the first-moment bound on the factored and compact 8-bit layouts, five "
             "models, 5 seeds", tuple(DROPIN_LR), on_factor("bound", "layout_w16", "layout_w16_bound"), seeds=5),
    Ablation("gefen_ablation_candidates_long", "the same candidates on the encoder at 3,000 steps, 5 seeds",
             variants=CANDIDATES, **LONG),
]}


def variant_layout(variant: str, bits: int = 8) -> GefenLayout:
    """The Gefen layout record of ``variant``: the published or factored layout at ``bits``, with a
    change's fields replaced (a kind of tensor keeps the layout; its tensors' v is a group's)."""
    own = variant.removeprefix(f"{FACTORED}+")
    base = FACTORED_MEASURED[bits] if variant.startswith(FACTORED) else layout_of("published", bits)
    return base.replace(**CHANGES[own]) if own in CHANGES else base


def per_element_v_groups(model, pattern, factored=False, **every):
    """Param groups: the tensors matching ``pattern`` with ``share_second_moment=False``, the rest
    with ``factor_second_moment=factored``; ``every`` (Gefen options) in both groups."""
    rx = re.compile(pattern) if pattern else None
    own = [p for n, p in model.named_parameters() if rx is not None and rx.search(n)]
    rest = [p for n, p in model.named_parameters() if rx is None or not rx.search(n)]
    return [g for g in ({"params": rest, "factor_second_moment": factored, **every},
                        {"params": own, "share_second_moment": False, **every}) if g["params"]]


def variant_groups(model, variant: str, arch: str = "gpt"):
    """Param groups of one Gefen ``variant``: its layout's per-group fields in every group, and a kind
    of tensor's own group with v per element."""
    own = variant.removeprefix(f"{FACTORED}+")
    factored = variant.startswith(FACTORED)
    if own in CHANGES:
        every = {k: v for k, v in CHANGES[own].items() if k not in OPTIMIZER_WIDE}
        return per_element_v_groups(model, None, factored, **every)
    groups = per_element_v_groups(model, None if own == FACTORED else PATTERNS[arch][own], factored)
    for group in groups:  # the kind's own tensors: v per element, not factored whatever the layout says
        if group.get("share_second_moment") is False:
            group["factor_second_moment"] = False
    return groups


class Final(NamedTuple):
    """What one run leaves: its final validation loss and its optimizer's state bytes per parameter
    (``registry.state_bytes``) at the end."""

    loss: float
    bytes_per_param: float


def final_loss(size: dict, variant: str | None, seed: int, lr: float, tracking: Tracking | None = None,
               bits: int = 8) -> Final:
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
        opt = make_optimizer(f"Gefen-{bits}bit", groups, lr, WEIGHT_DECAY, layout=variant_layout(variant, bits))
    run = tracking.train_run(model=char_lm_label(size), optimizer=name, lr=lr, seed=seed, config=dict(
        {k: v for k, v in size.items() if k not in ("lrs", "seeds")}, model=vars(cfg), params=n_params,
        variant=variant or "AdamW", bits=bits, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP)) if tracking else Run()
    with run:
        out = train_lm(model, opt, corpus[0], corpus[1], lr=lr, steps=size["steps"], batch=size["batch"], seed=seed,
                       eval_every=size["eval_every"], on_eval=live_logger(run, lambda: {"state/bytes": state_bytes(opt)}))
        run.summary(curve_summary(out["val"], out["train"], out["step_times"],
                                  extra={"params": n_params, "wall_seconds": out["wall"]}))
    return Final(out["final"], state_bytes(opt) / n_params)


def variants_of(ablation: Ablation, size_name: str, args) -> list[str]:
    """The peers and variants one configuration runs: the ablation's, or ``--variants`` (``none``
    first where the ablation runs it; in an ablation on the factor, a kind or change asked for alone
    runs on top of the factor); with ``--on-factored`` (or a size of ``on_factored``) every kind of
    tensor again on top of the factor."""
    names = list(args.variants or (QUICK_VARIANTS if args.quick and ablation.name == "gefen_ablation"
                                   else ablation.variants))
    if "none" in ablation.variants and "none" not in names:
        names = ["none"] + names
    if not any(v in KINDS for v in ablation.variants):  # an ablation on the factor
        names = list(dict.fromkeys(v if v in ("none", "all", FACTORED) or "+" in v else f"{FACTORED}+{v}"
                                   for v in names))
    if args.on_factored or (args.variants is None and not args.quick and size_name in ablation.on_factored):
        names += [f"{FACTORED}+{v}" for v in names if v not in (FACTORED, "none", "all") and "+" not in v]
    return list(args.peers) + names


def CHECK(args):
    """--ablation: 2 seeds, a fifth of its steps (at least 150)."""
    ablation = ABLATIONS[args.ablation]
    steps = ablation.steps or CHAR_LM[ablation.sizes[0]]["steps"]
    return {"--seeds": 2, "--steps": max(150, steps // 5)}


CHECK_NOTE = ("2 seeds and a fifth of the ablation's steps: which variants move the loss and which way, not by how "
              "much at the committed length, nor their spread over the committed seeds")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--ablation", "--experiment", dest="ablation", default="gefen_ablation", choices=ABLATIONS,
                        help="a row of ABLATIONS: its settings and results file (default: gefen_ablation)")
    parser.add_argument("--tiny", action="store_true", help="test size (seconds)")
    kinds = [*PATTERNS["gpt"], *CHANGES]
    parser.add_argument("--variants", nargs="+", default=None,
                        choices=[*(v for v in kinds if v not in UNDER_FACTOR), FACTORED,
                                 *(f"{FACTORED}+{v}" for v in kinds if v not in ("none", "all"))],
                        help="default: the ablation's (gefen_ablation --quick: " + ", ".join(QUICK_VARIANTS) + ")")
    parser.add_argument("--seeds", type=int, default=None, help="default: the ablation's, else the size's")
    parser.add_argument("--steps", type=int, default=None, help="default: the ablation's, else the size's")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate of every run (default: the ablation's, else DROPIN_LR per size)")
    parser.add_argument("--peers", nargs="*", default=None, choices=PEERS,
                        help="optimizers trained beside AdamW at the same lr (default: the ablation's)")
    parser.add_argument("--sizes", "--size", nargs="+", default=None, choices=list(CHAR_LM),
                        help="CHAR_LM sizes to ablate (default: the ablation's; --quick / --tiny: that size)")
    parser.add_argument("--on-factored", action="store_true",
                        help="also run every kind of tensor on top of the factored second moment")
    parser.add_argument("--bits", type=int, default=None, choices=(8, 4),
                        help="the first moment's code width of every Gefen variant (default: the ablation's)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="single-threaded runs at a time (default: 2 for the full run, 1 otherwise)")
    args = check.parse(parser, argv)
    torch.set_num_threads(1)
    ablation = ABLATIONS[args.ablation]
    full = not (args.tiny or args.quick)
    small = "tiny" if args.tiny else "quick"
    args.peers = list(ablation.peers if args.peers is None else args.peers)
    args.bits = args.bits or ablation.bits
    if full:  # a quick or tiny run keeps its size's one seed and steps
        args.seeds, args.steps = args.seeds or ablation.seeds, args.steps or ablation.steps
    size_names = args.sizes or list(ablation.sizes)
    if not full and args.sizes is None:  # the test or quick size once in each architecture
        first = {}
        for name in size_names:
            first.setdefault(CHAR_LM[name].get("arch", "gpt"), name)
        size_names = list(first.values())
    jobs = args.jobs or (2 if full else 1)
    configs = []
    for k, name in enumerate(size_names):
        size = dict(CHAR_LM[name])
        lr = args.lr or ablation.lr or DROPIN_LR.get(name, 3e-3)
        if not full and args.sizes is None:  # the test or quick size in that architecture
            name, size = small, dict(CHAR_LM[small], arch=size.get("arch", "gpt"))
        size["steps"] = args.steps or size["steps"]
        cfg, corpus, n_params = char_lm_problem(size)
        label = char_lm_label(size)
        seeds = list(range(args.seed, args.seed + (args.seeds or size["seeds"])))
        variants = variants_of(ablation, name, args)
        configs.append((size, dict(size, size=name, label=label, prefix="" if k == 0 else label + "/", seeds=seeds,
                                   variants=variants, model=vars(cfg), params=n_params, lr=lr,
                                   patterns={v: PATTERNS[size.get("arch", "gpt")].get(v.removeprefix(f"{FACTORED}+"))
                                             for v in variants})))
    config = dict(vars(args), experiment=args.ablation, jobs=jobs, **configs[0][1],
                  extra={c["label"]: c for _, c in configs[1:]})
    with Results(args.ablation, args, config=config) as res, RunPool(jobs) as pool:
        journal = (Journal.open(res.results_dir / "partial" / f"{args.ablation}.jsonl",
                                dict(bits=args.bits, configs=[c for _, c in configs], versions=res.versions,
                                     cpu=host_cpu()),
                                JOURNAL_CODE) if not args.check else None)
        if journal is not None and len(journal):
            print(f"[{args.ablation}] {len(journal)} runs finished earlier ({journal.path})", flush=True)

        def submit(size, c, v, s):
            return journaled(journal, (c["label"], v, s), lambda: pool.submit(
                final_loss, size, None if v == "AdamW" else v, s, c["lr"], res.tracking, args.bits),
                load=lambda value: Final(*value))
        runs = [(c, {v: [submit(size, c, v, s) for s in c["seeds"]] for v in ["AdamW", *c["variants"]]})
                for size, c in configs]
        for c, futs in runs:
            add_rows(res, c, {v: [f.result() for f in fs] for v, fs in futs.items()})
    if journal is not None:
        journal.remove()


def add_rows(res, c, finals):
    """One configuration's rows from {variant or "AdamW": [``Final`` per seed]}."""
    x = dict(x_name="steps", x_value=c["steps"])
    for name, runs in finals.items():
        for s, f in zip(c["seeds"], runs):
            res.add(c["prefix"] + name, "state_bytes_per_param", "B/param", f.bytes_per_param, seed=s, **x)
    losses = {name: [f.loss for f in runs] for name, runs in finals.items()}
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
