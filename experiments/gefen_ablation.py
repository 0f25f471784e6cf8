"""Where Gefen's loss gap to AdamW comes from: a per-element second moment on one kind of tensor.

    python experiments/gefen_ablation.py            # every tensor group, 3 seeds -> results/gefen_ablation.csv
    python experiments/gefen_ablation.py --quick    # 4 groups, 1 seed, the quick model -> results/quick/
    python analysis/gefen_ablation.py
    # which tensors carry the gap left by the factored second moment, on the larger model
    python experiments/gefen_ablation.py --size large --on-factored --variants none attn_qkv mlp_in

Each variant is 8-bit Gefen (registry name Gefen-8bit) with ``share_second_moment=False`` (a
per-element v, as block length 1) on the named group of tensors only, through a second parameter
group, everything else unchanged; ``none`` is Gefen as published, ``all`` shares v nowhere. The
model, data, schedule and sizes are experiments/convergence.py's (experiments/train.py's
``CHAR_LM`` and ``train_lm``), at one learning rate for every run (``--lr``), with the same
initialisation and batches per seed for every variant and for AdamW. ``factored`` is Gefen with
``factor_second_moment=True`` on every tensor (registry name Gefen-8bit-factored); with
``--on-factored`` every variant also runs on top of it (variant ``factored+<name>``: the named
tensors per element, the rest factored).

Rows: ``val_loss`` per variant (and AdamW) and seed, ``val_loss_vs_adamw`` (paired by seed), its
``_mean`` and ``_std``, and ``delta_vs_shared`` (the paired difference of ratios against ``none``),
its ``_mean`` and ``_std``; all against ``steps``.
"""

from __future__ import annotations

import argparse
import re
import statistics

import torch

from experiments.common import Results, add_common_args
from experiments.models import GPT
from experiments.registry import make_optimizer
from experiments.train import CHAR_LM, WEIGHT_DECAY, char_lm_problem, train_lm

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
FACTORED = "factored"  # every tensor shared and factored, none per element
QUICK_VARIANTS = ["none", "all", "attn_qkv", "embedding", FACTORED]


def per_element_v_groups(model, pattern, factored=False):
    """Param groups: the tensors matching ``pattern`` with ``share_second_moment=False``, the rest
    with ``factor_second_moment=factored``."""
    rx = re.compile(pattern) if pattern else None
    own = [p for n, p in model.named_parameters() if rx is not None and rx.search(n)]
    rest = [p for n, p in model.named_parameters() if rx is None or not rx.search(n)]
    return [g for g in ({"params": rest, "factor_second_moment": factored},
                        {"params": own, "share_second_moment": False}) if g["params"]]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--tiny", action="store_true", help="test size (seconds)")
    parser.add_argument("--variants", nargs="+", default=None,
                        choices=[*VARIANTS, FACTORED, *(f"{FACTORED}+{v}" for v in VARIANTS if v != "none")],
                        help="default: all (--quick: " + ", ".join(QUICK_VARIANTS) + ")")
    parser.add_argument("--seeds", type=int, default=None, help="default: the size's seeds (3 full, 1 quick)")
    parser.add_argument("--steps", type=int, default=None, help="default: the size's steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of every run")
    parser.add_argument("--size", default=None, choices=list(CHAR_LM), help="a CHAR_LM size other than the run's")
    parser.add_argument("--on-factored", action="store_true",
                        help="also run every variant on top of the factored second moment")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    size_name = args.size or ("tiny" if args.tiny else "quick" if args.quick else "full")
    size = dict(CHAR_LM[size_name])
    size["steps"] = args.steps or size["steps"]
    variants = args.variants or (QUICK_VARIANTS if args.quick else [*VARIANTS, FACTORED])
    if "none" not in variants:
        variants = ["none"] + variants
    if args.on_factored:
        variants += [f"{FACTORED}+{v}" for v in variants if v not in (FACTORED, "none") and "+" not in v]
    seeds = list(range(args.seed, args.seed + (args.seeds or size["seeds"])))
    cfg, corpus, n_params = char_lm_problem(size)
    x = dict(x_name="steps", x_value=size["steps"])

    def final_loss(make_params, name, seed):
        torch.manual_seed(seed)
        model = GPT(cfg)
        opt = make_optimizer(name, make_params(model), args.lr, WEIGHT_DECAY)
        return train_lm(model, opt, corpus[0], corpus[1], lr=args.lr, steps=size["steps"], batch=size["batch"],
                        seed=seed, eval_every=size["steps"])["final"]

    config = dict(vars(args), size=size_name, **dict(size, seeds=seeds), variants=variants, model=vars(cfg),
                  params=n_params, patterns={v: VARIANTS.get(v.removeprefix(f"{FACTORED}+")) for v in variants})
    with Results("gefen_ablation", args, config=config) as res:
        base = [final_loss(lambda m: m.parameters(), "AdamW", s) for s in seeds]
        for s, v in zip(seeds, base):
            res.add("AdamW", "val_loss", "nats/char", v, seed=s, **x)
        ratios = {}
        for name in variants:
            factored = name.startswith(FACTORED)
            pattern = VARIANTS.get(name.removeprefix(f"{FACTORED}+"))
            vals = [final_loss(lambda m: per_element_v_groups(m, pattern, factored), "Gefen-8bit", s)
                    for s in seeds]
            ratios[name] = [v / b for v, b in zip(vals, base)]
            for s, v, r in zip(seeds, vals, ratios[name]):
                res.add(name, "val_loss", "nats/char", v, seed=s, **x)
                res.add(name, "val_loss_vs_adamw", "ratio", r, seed=s, **x)
            res.add(name, "val_loss_vs_adamw_mean", "ratio", statistics.fmean(ratios[name]), **x)
            res.add(name, "val_loss_vs_adamw_std", "ratio", _std(ratios[name]), **x)
            res.flush()
            print(f"[gefen_ablation] per-element v on {name}: {statistics.fmean(ratios[name]):.4f} "
                  f"+- {_std(ratios[name]):.4f} x AdamW over {len(seeds)} seeds", flush=True)
        for name in variants:
            deltas = [r - r0 for r, r0 in zip(ratios[name], ratios["none"])]
            res.add(name, "delta_vs_shared_mean", "ratio", statistics.fmean(deltas), **x)
            res.add(name, "delta_vs_shared_std", "ratio", _std(deltas), **x)


def _std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


if __name__ == "__main__":
    main()
