"""Do large mixed Hessian entries keep squared-gradient ratios stable, and do Gefen's blocks
(found from the first squared gradients) group such parameters?

    python experiments/hessian_alignment.py             # full run -> results/hessian_alignment.csv
    python experiments/hessian_alignment.py --quick     # smaller models, fewer steps -> results/quick/
    python analysis/hessian_alignment.py                # paper_figs/hessian_alignment.png

The Gefen article (arXiv 2606.13894) motivates its shared second moment with the statement that a
large mixed Hessian entry H_ij keeps g_i**2 / g_j**2 near one, so Hessian-aligned parameters can
share one v, and that blocks found from the initial squared gradients capture this. This experiment
measures both halves on two models whose full Hessian fits on a CPU (a one-block character
transformer and a character MLP on Python's documentation topics, a few thousand parameters
each):

1. pairs: at initialisation and at checkpoints of AdamW training, the full Hessian H of the loss on a
   fixed probe batch and the gradients of K probe minibatches. For every pair of parameters (all
   pairs, upper triangle), coupling |H_ij| / sqrt(|H_ii H_jj|) against spread = std over the K
   minibatches of log(g_i**2 / g_j**2) and against level = |log(E g_i**2 / E g_j**2)|: medians per
   coupling decile and Spearman rank correlations.
2. blocks: within-block coupling, within-block spread and dispersion (RMS of log(v_i / block mean v))
   for Gefen's blocks (both rules of ``optim.gefen.partition``), random blocks of the same sizes,
   Adam-mini's name-based blocks and one block per tensor (``experiments/harness/_hessian_blocks.py``).
3. loss: each block scheme trained with a shared, unquantised second moment (``SharedVAdam``) against
   ``torch.optim.AdamW``, same steps, lr and batches, several seeds; validation loss at the end.
   ``gefen_factored`` adds Gefen's factored second moment (per-offset factor inside the blocks).
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import time

import torch
from torch.func import grad_and_value, vmap
from tqdm import tqdm

from experiments.harness._hessian_blocks import FACTORED, SCHEMES, SharedVAdam, block_stats, factor_ids, scheme_ids
from experiments.harness._hessian_models import (
    FlatModel, build_model, hessian, load_text_ids, minibatch_grads, sample_batch,
)
from experiments.harness import check
from experiments.harness.common import Results, add_common_args

NAME = "hessian_alignment"
BLOCK_SCHEMES = tuple(s for s in SCHEMES if s != "per_element")
LOSS_SCHEMES = BLOCK_SCHEMES + FACTORED  # trained in section 3; FACTORED shares "gefen"'s block statistics
# d_model=16 and hidden=32 are the smallest widths at which Gefen's rules can pick a row (p > 8)
# as a block; the models then have about 3,000 parameters each.
FULL = dict(vocab=16, ctx=16, d_model=16, n_heads=2, d_ff=32, context=3, hidden=32, batch=16,
            probe_batches=64, hess_batches=1, steps=400, checkpoints=3, seeds=3, lr=3e-3)
QUICK = dict(vocab=12, ctx=8, d_model=12, n_heads=2, d_ff=24, context=2, hidden=24, batch=16,
             probe_batches=16, hess_batches=1, steps=60, checkpoints=2, seeds=2, lr=3e-3)


# ---------------------------------------------------------------------------- pair statistics
# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {}
CHECK_NOTE = ("the full run's size (400 steps, 3 seeds, two small models): the claim itself")


def pair_matrices(H: torch.Tensor, G: torch.Tensor):
    """coupling, spread, level, |gradient correlation| [n, n] (float64) and the active mask, from a
    Hessian and [K, n] minibatch gradients.

    Active entries have a nonzero gradient on every probe minibatch and a nonzero Hessian diagonal;
    pair statistics involving an inactive entry are NaN.
    """
    H, G = H.double(), G.double()
    d = H.diagonal().abs()
    active = (G != 0).all(0) & (d > 1e-12 * d.max())
    L = torch.log(G * G)
    L = torch.where(active, L, 0.0)
    Lc = L - L.mean(0)
    cov = Lc.T @ Lc / (G.shape[0] - 1)
    var = cov.diagonal()
    spread = (var[:, None] + var[None, :] - 2 * cov).clamp_min(0).sqrt()
    logv = torch.log((G * G).mean(0))
    level = (logv[:, None] - logv[None, :]).abs()
    coupling = H.abs() / (d[:, None] * d[None, :]).sqrt()
    Gc = G - G.mean(0)
    nrm = Gc.norm(dim=0).clamp_min(1e-300)
    gcorr = (Gc.T @ Gc / (nrm[:, None] * nrm[None, :])).abs()
    bad = ~(active[:, None] & active[None, :])
    for m in (coupling, spread, level, gcorr):
        m[bad] = float("nan")
    return coupling, spread, level, gcorr, active


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation with average ranks for ties."""
    def ranks(x):
        _, inv, cnt = torch.unique(x, return_inverse=True, return_counts=True)
        start = torch.cumsum(cnt, 0) - cnt
        return (start + (cnt - 1) / 2.0).double()[inv]

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def pair_summary(coupling, spread, level, gcorr, same_tensor, deciles=10) -> dict:
    """Per-coupling-decile medians and rank correlations over all active pairs i < j."""
    n = coupling.shape[0]
    iu = torch.triu_indices(n, n, 1)
    c, s, lv = coupling[iu[0], iu[1]], spread[iu[0], iu[1]], level[iu[0], iu[1]]
    gc, st = gcorr[iu[0], iu[1]], same_tensor[iu[0], iu[1]]
    ok = ~c.isnan()
    c, s, lv, gc, st = c[ok], s[ok], lv[ok], gc[ok], st[ok]
    order = torch.argsort(c)
    bins = []
    for k, idx in enumerate(torch.tensor_split(order, deciles)):
        bins.append(dict(decile=k + 1, coupling=float(c[idx].median()), spread=float(s[idx].median()),
                         level=float(lv[idx].median()), gradcorr=float(gc[idx].median()),
                         pairs=int(idx.numel())))
    top = order[-max(1, len(order) // 100):]
    return dict(
        bins=bins, pairs=int(len(c)),
        spearman_spread=spearman(c, s), spearman_level=spearman(c, lv), spearman_gradcorr=spearman(c, gc),
        spearman_gradcorr_spread=spearman(gc, s),
        spearman_spread_same_tensor=spearman(c[st], s[st]) if st.sum() > 2 else float("nan"),
        spread_median_all=float(s.median()), spread_median_top1pct=float(s[top].median()),
        level_median_all=float(lv.median()), level_median_top1pct=float(lv[top].median()),
        coupling_median_top1pct=float(c[top].median()),
    )


# ------------------------------------------------------------------------------------ helpers
def model_size(cfg: dict, kind: str) -> dict:
    if kind == "transformer":
        return dict(ctx=cfg["ctx"], d_model=cfg["d_model"], n_heads=cfg["n_heads"], d_ff=cfg["d_ff"])
    return dict(context=cfg["context"], hidden=cfg["hidden"])


def seq_len(cfg: dict, kind: str) -> int:
    return cfg["ctx"] if kind == "transformer" else cfg["ctx"] + cfg["context"] - 1


def batches(ids, cfg, kind, count, seed):
    gen = torch.Generator().manual_seed(seed)
    xy = [sample_batch(ids, cfg["batch"], seq_len(cfg, kind), gen) for _ in range(count)]
    return torch.stack([x for x, _ in xy]), torch.stack([y for _, y in xy])


def all_schemes(fm, first_grad, cfg, seed):
    kw = dict(first_grad=first_grad, n_heads=cfg["n_heads"], d_model=cfg["d_model"], seed=seed)
    return {s: scheme_ids(s, fm.tensor_slices(), **kw) for s in BLOCK_SCHEMES}


def eval_loss(fm, flat, xs, ys) -> float:
    with torch.no_grad():
        return float(torch.stack([fm.loss(flat, x, y) for x, y in zip(xs, ys)]).mean())


# ----------------------------------------------------------------------------------- sections
def checkpoint_stats(kind, step, fm, p, probe, schemes, same_tensor, cfg, res):
    """Hessian, probe gradients, pair statistics and block statistics at one checkpoint."""
    px, py = probe
    t0 = time.perf_counter()
    H = hessian(fm, p, px[: cfg["hess_batches"]].flatten(0, 1), py[: cfg["hess_batches"]].flatten(0, 1),
                chunk=cfg.get("chunk", 128))
    G = minibatch_grads(fm, p, px, py)
    res.add(kind, "hessian_seconds", "s", time.perf_counter() - t0, x_name="step", x_value=step)
    coupling, spread, level, gcorr, active = pair_matrices(H, G)
    summ = pair_summary(coupling, spread, level, gcorr, same_tensor)
    v = (G.double() ** 2).mean(0)
    var = f"{kind}/step{step}"
    for b in summ["bins"]:
        for key, unit in (("coupling", "ratio"), ("spread", "std log ratio"), ("level", "abs log ratio"),
                          ("gradcorr", "abs corr")):
            res.add(var, f"{key}_median", unit, b[key], x_name="coupling_decile", x_value=b["decile"])
        res.add(var, "pairs", "count", b["pairs"], x_name="coupling_decile", x_value=b["decile"])
    for key in ("spearman_spread", "spearman_level", "spearman_gradcorr", "spearman_gradcorr_spread",
                "spearman_spread_same_tensor", "spread_median_all", "spread_median_top1pct", "level_median_all",
                "level_median_top1pct", "coupling_median_top1pct", "pairs"):
        res.add(kind, key, "", summ[key], x_name="step", x_value=step)
    res.add(kind, "n_active", "count", int(active.sum()), x_name="step", x_value=step)
    for s, ids in [("per_element", torch.arange(fm.n))] + list(schemes.items()):
        for key, val in block_stats(ids, coupling, spread, v, active).items():
            res.add(f"{kind}/{s}", key, "", val, x_name="step", x_value=step)
    res.flush()
    return summ


def run_model(kind, cfg, data, res, seeds, bar, with_losses=True):
    """Train every (seed, scheme) member on the same batches; Hessian checkpoints on AdamW's first seed.

    Every (seed, scheme) pair is one row of a stacked [members, n] parameter matrix trained with one
    vmapped forward/backward per step (the per-op overhead of a ~3k-parameter model dominates a
    step, so 21 members cost a few single steps). The optimizer is one ``SharedVAdam`` over the
    stacked vector with block ids offset per member; AdamW is its one-block-per-entry member
    (tests/test_hessian_alignment.py holds it to ``torch.optim.AdamW``). Block schemes come from
    each seed's first gradient (its first training minibatch at initialisation), as Gefen does.
    """
    train, val = data
    names = ("adamw",) + (LOSS_SCHEMES if with_losses else ())
    seeds = seeds if with_losses else seeds[:1]
    vx, vy = batches(val, cfg, kind, 16, 30_000)
    flats, ids, fids, xs, ys, members, first = [], [], [], [], [], [], None
    for seed in seeds:
        fm = FlatModel(build_model(kind, cfg["vocab"], model_size(cfg, kind), seed))
        tx, ty = batches(train, cfg, kind, cfg["steps"], seed + 20_000)
        init = fm.initial()
        first_grad = minibatch_grads(fm, init, tx[:1], ty[:1])[0]
        schemes = all_schemes(fm, first_grad, cfg, seed)
        first = first or schemes
        for s in names:
            members.append((seed, s))
            flats.append(init)
            ids.append(torch.arange(fm.n) if s == "adamw" else
                       scheme_ids(s, fm.tensor_slices(), first_grad=first_grad) if s in FACTORED else schemes[s])
            fids.append(factor_ids(s, fm.tensor_slices(), first_grad=first_grad))
            xs.append(tx)
            ys.append(ty)
    res.add(kind, "n_params", "count", fm.n)
    for rule in ("gefen", "gefen_var"):
        for name, _, sl in fm.tensor_slices():
            seg = first[rule][sl]
            res.add(f"{kind}/{rule}/{name}", "block_length", "entries", (seg == seg[0]).sum(), x_name="numel",
                    x_value=sl.stop - sl.start)
    tensor_id = torch.cat([torch.full((sl.stop - sl.start,), t) for t, (_, _, sl) in enumerate(fm.tensor_slices())])
    same_tensor = tensor_id[:, None] == tensor_id[None, :]
    probe = batches(train, cfg, kind, cfg["probe_batches"], seeds[0] + 10_000)
    marks = sorted({round(i * cfg["steps"] / (cfg["checkpoints"] - 1)) for i in range(cfg["checkpoints"])})

    offs = foffs = toffs = 0
    for k, b_ids in enumerate(ids):
        ids[k] = b_ids + offs
        offs = int(ids[k].max()) + 1
        f, ft = fids[k]
        fids[k] = (f + foffs, ft + toffs)
        foffs, toffs = foffs + ft.numel(), toffs + int(ft.max()) + 1
    W = torch.stack(flats)
    X, Y = torch.stack(xs, 1), torch.stack(ys, 1)  # [steps, members, batch, length]
    opt = SharedVAdam(torch.cat(ids), lr=cfg["lr"], weight_decay=0.01,
                      factors=(torch.cat([f for f, _ in fids]), torch.cat([t for _, t in fids])))
    grads_and_losses = vmap(grad_and_value(fm.loss), in_dims=(0, 0, 0))
    every = max(1, cfg["steps"] // 10)
    run = torch.zeros(len(members))
    for step in range(cfg["steps"] + 1):
        if step in marks:  # member 0 is AdamW on the first seed
            summ = checkpoint_stats(kind, step, fm, W[0].clone(), probe, first, same_tensor, cfg, res)
            bar.set_postfix_str(f"{kind} step {step}: rho={summ['spearman_spread']:+.3f}")
        if step == cfg["steps"]:
            break
        G, L = grads_and_losses(W, X[step], Y[step])
        run += L
        opt.step(W.view(-1), G.reshape(-1))
        if (step + 1) % every == 0:
            for (seed, s), val_ in zip(members, (run / every).tolist()):
                res.add(f"{kind}/{s}", "train_loss", "nats", val_, x_name="step", x_value=step + 1, seed=seed)
            run.zero_()
        bar.update(1)
    for k, (seed, s) in enumerate(members):
        res.add(f"{kind}/{s}", "val_loss", "nats", eval_loss(fm, W[k], vx, vy), x_name="steps",
                x_value=cfg["steps"], seed=seed)
        res.add(f"{kind}/{s}", "second_moments", "count", int(ids[k].max() - ids[k].min()) + 1, seed=seed)
    res.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--models", default="transformer,mlp", help="comma list of transformer, mlp")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a size/run setting ({', '.join(FULL)}), e.g. --set steps=20")
    parser.add_argument("--skip-losses", action="store_true", help="only pair and block statistics")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: the models are tiny)")
    args = check.parse(parser, argv)
    torch.set_num_threads(args.threads)
    cfg = dict(QUICK if args.quick else FULL)
    for kv in args.set:
        key, _, val = kv.partition("=")
        if key not in cfg and key != "chunk":
            raise SystemExit(f"--set {kv}: unknown setting {key!r}; known: {', '.join(cfg)}")
        cfg[key] = float(val) if key == "lr" else int(val)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in ("transformer", "mlp"):
            raise SystemExit(f"--models: unknown model {m!r}; choose from transformer, mlp")
    torch.manual_seed(args.seed)
    data = load_text_ids(cfg["vocab"])[:2]
    config = dict(vars(args), **cfg, models=models)
    seeds = [args.seed + i for i in range(cfg["seeds"])]
    with Results(NAME, args, config=config) as res, tqdm(total=len(models) * cfg["steps"], desc=NAME,
                                                          mininterval=2, unit="step") as bar:
        for kind in models:
            run_model(kind, cfg, data, res, seeds, bar, with_losses=not args.skip_losses)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
