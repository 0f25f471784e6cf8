"""The claims table's rows of Gefen (``analysis/claims.py``), one function a row."""

from __future__ import annotations

import math
import statistics

from analysis.common import GEFEN_TARGET_BPP, TARGET_WIDTH, ResultsError, select
from analysis.gefen_ablation import REPORT as ABLATIONS_REPORT
from analysis import codebook, convergence
from analysis import gefen_memory as memory
from analysis import gefen_peak_memory as peak_memory
from analysis.gefen_memory import TARGET_FACTORED_STEP
from analysis.gefen_speed import TARGET_CPU, TARGET_SMALL
from experiments.gefen_ablation import REFRESH_EVERY
from analysis.claims_common import (Row, cmd, fig, joined, listed, median_over_seeds, pct, pct_range, points, sci,
                                   signed, span, times)

LOSS_TARGET = {"8bit": 0.003, "4bit": 0.006}  # factored Gefen: loss within +0.3% / +0.6% of AdamW's
BF16_TARGET = 0.005  # bf16 weights with stochastic rounding: within +0.5% of fp32 AdamW's loss
QUALITY_TOL = 0.03  # "AdamW's quality": within 3% of AdamW's loss
THREADS = 1.0  # the CPU step times the speed row quotes: one torch thread
LAUNCH_TARGET = 8  # Gefen's Triton path: at most this many launches a step after the first
S1_RHO, S3_NATS = 0.3, 0.01  # Hessian statements: |ρ| below this is no correlation; a tie in nats
MODELS = {"char-gpt-116k": "116k", "char-gpt-1266k": "1.27M", "char-gpt-429k-docstrings": "429k prose"}


def gefen_memory(R):
    e = "gefen_memory"
    b8, b4, adamw = (R.need(e, "state_bytes_per_param", v, x_value="transformer")
                     for v in ("Gefen-8bit", "Gefen-4bit", "AdamW"))
    verdict = "reproduced" if b8 <= GEFEN_TARGET_BPP["Gefen-8bit"] else "not met"
    mlp = [R.need(e, "state_bytes_per_param", v, x_value="mlp") for v in ("Gefen-8bit", "AdamW")]
    detail = (f"AdamW keeps {adamw / b8:.1f} times Gefen 8-bit's state on the transformer and {mlp[1] / mlp[0]:.1f} "
              f"times on the MLP ({mlp[0]:.3f} B/param). The section adds every peer's bytes, the bytes by kind of tensor "
              "and the CPU step times.")
    return Row("Gefen keeps about 1 B/param of state (AdamW: 8)", verdict,
               memory.headline(R.rows(e)), fig(e),
               cmd(f"python experiments/{e}.py"), detail)


def _model_prefix(model) -> str:
    """The variant prefix of ``model`` in convergence.csv: "" for the first model, else "<model>/"."""
    return "" if model == next(iter(MODELS)) else f"{model}/"


def gefen_quality(R):
    e = "convergence"
    gaps = [R.need(e, "val_loss_vs_adamw_median", "Gefen-8bit", x_value=m) for m in MODELS]
    within = sum(g - 1 <= QUALITY_TOL for g in gaps)
    verdict = (f"reproduced with caveats: within {QUALITY_TOL:.0%} on {within} of {len(gaps)} models"
               if within else "not met")
    parts = []
    for m, name in MODELS.items():
        g8, g4 = (R.need(e, "val_loss_vs_adamw_median", f"Gefen-{b}", x_value=m) for b in ("8bit", "4bit"))
        seeds = R.values(e, "val_loss_vs_adamw", "Gefen-8bit", x_value=m)
        ok = sum(s - 1 <= QUALITY_TOL for s in seeds)
        parts.append(f"{pct(g8)} / {pct(g4)} ({name}, {len(seeds)} seeds, {ok} of them within {QUALITY_TOL:.0%} at 8 bits)")
    upstream = [f"{pct(R.need(e, 'val_loss_vs_adamw_median', 'gefen-upstream', x_value=m))} ({name})"
                for m, name in MODELS.items() if select(R.rows(e), "val_loss_vs_adamw_median", "gefen-upstream", x_value=m)]
    detail = (f"Validation loss over AdamW's, median over seeds paired by seed, 8-bit / 4-bit: {'; '.join(parts)}; upstream `gefen` "
              f"{listed(upstream)}. Each optimizer runs at its best lr of a grid.")
    return Row("Gefen trains at AdamW's quality", verdict,
               f"8-bit {' / '.join(pct(g) for g in gaps)} vs AdamW's loss ({' / '.join(MODELS.values())}; median of seeds)",
               fig(e), cmd(f"python experiments/{e}.py"), detail)


def gefen_ablation(R):
    e = "gefen_ablation"
    every = R.median(e, "val_loss_vs_adamw", "all")
    shared = R.median(e, "val_loss_vs_adamw", "none")
    prose = "char-gpt-429k-docstrings/"

    def mean(v):
        return R.median(e, "val_loss_vs_adamw", v)

    kinds = sorted({r["variant"][len(prose + "factored+"):] for r in select(R.rows(e), "val_loss_vs_adamw")
                    if r["variant"].startswith(prose + "factored+")})
    base = mean(prose + "factored")
    moves = [abs(mean(f"{prose}factored+{k}") - base) for k in kinds]
    spread = statistics.median(R.values(e, "val_loss_vs_adamw_std", prose + "factored"))
    detail = (f"Per-element v everywhere leaves {pct(every)} ({MODELS['char-gpt-116k']}) and {pct(mean(prose + 'all'))} "
              f"({MODELS[prose[:-1]]}); on the "
              f"attention input matrices alone {pct(mean('attn_qkv'))} / {pct(mean(prose + 'attn_qkv'))}; the factored "
              f"second moment {pct(mean('factored'))} / {pct(base)}, and per-element v on any one kind of tensor on top of "
              f"it moves the prose model by at most {max(moves) * 100:.2f} points (its seeds' standard deviation: "
              f"{spread * 100:.1f} points). Medians over seeds, paired by seed.")
    return Row("… the gap is the shared second moment", "found here",
               f"v per element everywhere: {pct(every)} vs AdamW's loss (shared v: {pct(shared)}; {MODELS['char-gpt-116k']} model)",
               fig(e), cmd(f"python experiments/{e}.py"), detail)


def _layout(R, e, layout, protocols=("", "dropin/"), prefix="", **where):
    """(8-bit, 4-bit) median loss ratios of Gefen-<bits>-``layout``, the worst of ``protocols``
    (variant prefixes), and their mean state B/param (variants ``prefix`` + name)."""
    names = [f"Gefen-{b}-{layout}" for b in ("8bit", "4bit")]
    loss = [max(R.need(e, "val_loss_vs_adamw_median", p + n, **where) for p in protocols) for n in names]
    return loss, [_state(R, e, prefix + n) for n in names]


def _factored(R, e, model, prefix=""):
    """(8-bit, 4-bit) loss ratios of the factored layout (``convergence.factored_loss``, the figure's
    numbers) and its mean state B/param."""
    seeds = R.rows(SEEDS, "val_loss_vs_adamw") if convergence.seeds_prefix(model) is not None else None
    loss = convergence.factored_loss(R.rows(e, "val_loss_vs_adamw_median"), model, prefix, seeds)
    return loss, [_state(R, e, prefix + f"Gefen-{b}-factored") for b in ("8bit", "4bit")]


SEEDS, SEEDS_NAMES = convergence.SEEDS, convergence.SEEDS_NAMES  # the drop-in protocol on many seeds


def _seeds_count(R) -> int:
    """How many seeds the runs on many seeds have."""
    return len(R.config(SEEDS)["seeds"])


def _seeds_prefix(R, model):
    """The variant prefix of convergence model ``model`` (a label) in the runs on many seeds, or None."""
    return convergence.seeds_prefix(model)


def _state(R, e, variant):
    """Mean state bytes per parameter of ``variant`` over its seeds."""
    return statistics.fmean(R.values(e, "state_bytes_per_param", variant))


def _compact(R, e, protocols, **where) -> str:
    """The sentence on Gefen-X's-bytes layout (``layout="compact"``) in convergence experiment ``e``:
    each width's median loss ratio, the worst of ``protocols`` (variant prefixes), and its state; empty
    where the run has no compact rows."""
    have = set(variants_of(R, e, "val_loss_vs_adamw_median"))
    if not all(f"{p}Gefen-{b}-compact" in have for p in protocols for b in ("8bit", "4bit")):
        return ""
    loss, state = _layout(R, e, "compact", protocols, protocols[0], **where)
    return (f" The compact layout (gefen-x's bytes or fewer): 8-bit {pct(loss[0])}, 4-bit {pct(loss[1])} at "
            f"{state[0]:.3f} / {state[1]:.3f} B/param.")


def _factored_verdict(losses, states):
    """Loss met where both widths are within their targets; bytes met where both are within theirs."""
    loss_ok = [l8 - 1 <= LOSS_TARGET["8bit"] and l4 - 1 <= LOSS_TARGET["4bit"] for l8, l4 in losses]
    bytes_ok = all(s8 <= GEFEN_TARGET_BPP["Gefen-8bit-factored"] and s4 <= GEFEN_TARGET_BPP["Gefen-4bit-factored"]
                   for s8, s4 in states)
    return loss_ok, "bytes met" if bytes_ok else "bytes not met"


def _lr_share(variant) -> str:
    """"0.6×" from a drop-in variant named "gefen-x@0.6" (its lr as a share of AdamW's)."""
    return f"{float(variant.rpartition('@')[2]):g}×"


def _by_kind(R, model, name, kind):
    return R.need("gefen_memory", "state_bytes_per_param_of_kind", f"{model}/{name}", x_value=kind)


def _factored_detail(R, e):
    names = list(MODELS.values())

    def med(v, m):
        return R.need(e, "val_loss_vs_adamw_median", v, x_value=m)

    seeds = [len(R.values(e, "val_loss_vs_adamw", "Gefen-8bit-factored", x_value=m)) for m in MODELS]
    prose = list(MODELS)[-1]
    spread = R.values(e, "val_loss_vs_adamw", "Gefen-8bit-factored", x_value=prose)
    at = {p: {b: [med(f"{p}Gefen-{b}-factored", m) for m in MODELS] for b in ("8bit", "4bit")} for p in ("", "dropin/")}
    published = [R.need(e, "val_loss_vs_adamw_median", "Gefen-8bit", x_value=m) for m in MODELS]
    share = next(v for v in variants_of(R, e, "val_loss_vs_adamw_median") if v.startswith("dropin/gefen-x@"))
    gx = {"own": [med("gefen-x", m) for m in MODELS], "dropin": [med("dropin/gefen-x", m) for m in MODELS],
          "share": [med(share, m) for m in MODELS]}
    state = [[_state(R, e, _model_prefix(m) + f"Gefen-{b}-factored") for m in MODELS] for b in ("8bit", "4bit")]
    gx_state = [_state(R, e, _model_prefix(m) + "gefen-x") for m in MODELS]
    reach = {b: [n for n, ours, x in zip(names, at[""][b], gx["own"]) if ours <= x] for b in ("8bit", "4bit")}
    kinds = [m for m in ("char-gpt-116k", "char-encoder-430k", "char-llama-427k")
             if select(R.rows("gefen_memory"), "state_bytes_per_param_of_kind", f"{m}/Gefen-8bit-factored")]
    vec = [_by_kind(R, m, "Gefen-8bit-factored", "vector") for m in kinds]
    gx_vec = [_by_kind(R, m, "gefen-x", "vector") for m in kinds]
    width = R.config(e)["n_embd"]
    big = [R.need("gefen_memory", "state_bytes_per_param", f"Gefen-{b}-factored", x_value="transformer")
           for b in ("8bit", "4bit")]
    steps = [R.need("gefen_speed", "step_time_vs_unfactored", f"{m}/Gefen-{b}-factored", x_value=1.0)
             for m in ("transformer", "mlp") for b in ("8bit", "4bit")]
    return (f"Factored / AdamW final loss, medians paired by seed ({' / '.join(map(str, seeds))} seeds), 8-bit / 4-bit "
            f"per model ({' / '.join(names)}): each optimizer at its best lr of a grid {joined(at['']['8bit'], pct)} and "
            f"{joined(at['']['4bit'], pct)}; under the drop-in protocol (AdamW's lr for all) {joined(at['dropin/']['8bit'], pct)} "
            f"and {joined(at['dropin/']['4bit'], pct)}. The prose model's seeds spread {pct_range(spread)} at 8 bits (the "
            f"optimizers differ in when a loss plateau ends). Published Gefen {joined(published, pct)} (8-bit); "
            f"gefen-x {joined(gx['own'], pct)} at its best lr, {joined(gx['dropin'], pct)} at AdamW's, and {joined(gx['share'], pct)} at "
            f"the {_lr_share(share)} its README advises. So the factored 8-bit reaches gefen-x's loss on "
            f"{listed(reach['8bit']) or 'none of the models'}, the 4-bit on {listed(reach['4bit']) or 'none'}. "
            f"State: {' / '.join(f'{x:.3g}' for x in state[0])} B/param at 8 bits, "
            f"{' / '.join(f'{x:.2f}' for x in state[1])} at 4 (gefen-x {' / '.join(f'{x:.3f}' for x in gx_state)}). "
            f"Which tensors carry the bytes (section \"Gefen: optimizer memory\", its seed): the vectors at "
            f"{min(vec):.1f}–{max(vec):.1f} B/param (a v per element; gefen-x {min(gx_vec):.1f}–{max(gx_vec):.1f}), the "
            f"{names[0]} model's matrices at {_by_kind(R, 'char-gpt-116k', 'Gefen-8bit-factored', 'matrix'):.3f} (width "
            f"{width}: a scale, a v and a column-factor share per row), the embeddings where the rule keeps a table per "
            f"element. On the memory benchmark's transformer the factored state is {big[0]:.3f} / {big[1]:.3f} B/param "
            f"(targets {GEFEN_TARGET_BPP['Gefen-8bit-factored']:g} / {GEFEN_TARGET_BPP['Gefen-4bit-factored']:g}). The "
            f"numba step on one thread takes {min(steps):.2f}–{max(steps):.2f} times the unfactored step's time on the "
            f"transformer and MLP (target at most {TARGET_FACTORED_STEP:g}: the factor adds a pass over the gradients, "
            "and a tiled matrix is stepped as several tensors).")


def variants_of(R, e, metric):
    return list(dict.fromkeys(r["variant"] for r in select(R.rows(e, metric), metric)))


def gefen_factored(R):
    e = "convergence"
    prefixes = ["", "char-gpt-1266k/", "char-gpt-429k-docstrings/"]
    out = [_factored(R, e, m, p) for m, p in zip(MODELS, prefixes)]
    loss_ok, bytes_word = _factored_verdict([o[0] for o in out], [o[1] for o in out])
    names = list(MODELS.values())
    many = {n: f" ({_seeds_count(R)} seeds)" if _seeds_prefix(R, m) is not None else "" for m, n in zip(MODELS, names)}
    met = [n + many[n] for n, ok in zip(names, loss_ok) if ok]
    missed = [n + many[n] for n, ok in zip(names, loss_ok) if not ok]
    verdict = (f"loss met on {', '.join(met) or 'none'}" + (f"; not on {', '.join(missed)}" if missed else "")
               + f"; {bytes_word}")
    head = (f"worse protocol: 8-bit {' / '.join(pct(o[0][0]) for o in out)}, 4-bit {' / '.join(pct(o[0][1]) for o in out)}; "
            f"8-bit state {' / '.join(f'{o[1][0]:.2f}' for o in out)} B/param ({' / '.join(names)})")
    return Row("Gefen at AdamW's loss with a factored second moment (ours), both protocols", verdict, head,
               fig(e), cmd(f"python experiments/{e}.py"),
               " ".join([_factored_detail(R, e), *(_many_seeds(R, m) for m in MODELS if _seeds_prefix(R, m) is not None)]))


def _ablation_arch(R, prefix):
    """What the committed architecture ablation finds for one model: medians by seed."""
    a = "gefen_ablation_arch"

    def med(v):
        return R.median(a, "val_loss_vs_adamw", prefix + v)

    kinds = sorted({r["variant"][len(prefix + "factored+"):] for r in select(R.rows(a, "val_loss_vs_adamw"), "val_loss_vs_adamw")
                    if r["variant"].startswith(prefix + "factored+") and "/" not in r["variant"][len(prefix):]})
    fp32 = [k for k in kinds if k.startswith("fp32")]
    kinds = [k for k in kinds if k not in fp32]
    moved = sorted((med("factored+" + k), k) for k in kinds)
    seeds = sorted({r["seed"] for r in select(R.rows(a), "val_loss_vs_adamw", prefix + "factored")}, key=str)
    spread = statistics.median(R.values(a, "val_loss_vs_adamw_std", prefix + "factored"))
    return (f"The committed ablation (section \"Gefen: what the factored second moment leaves\", seeds "
            f"{', '.join(map(str, seeds))}, AdamW's lr) puts the factored 8-bit at {pct(med('factored'))} and v per "
            f"element everywhere at {pct(med('all'))}: per-element v on any one kind of matrix on top of the factor "
            f"moves the median between {pct(moved[0][0])} (`{moved[0][1]}`) and {pct(moved[-1][0])} (`{moved[-1][1]}`), "
            f"the first moment in fp32 {pct(med('factored+' + fp32[0])) if fp32 else '—'}; the factored run's seeds have "
            f"a standard deviation of {spread * 100:.2f} points.")


def _untuned(R, e, model, claim, about, ablation_prefix):
    """A row of a model Gefen was not tuned on; ``about`` says what the architecture is, in words."""
    loss, state = _factored(R, e, model)
    loss_ok, bytes_word = _factored_verdict([loss], [state])
    verdict = ("loss met" if loss_ok[0] else "loss not met") + f"; {bytes_word}"
    many = f"; drop-in: {_seeds_count(R)} seeds" if _seeds_prefix(R, model) is not None else ""
    head = (f"8-bit {pct(loss[0])}, 4-bit {pct(loss[1])} vs AdamW (both protocols{many}); {state[0]:.2f} / "
            f"{state[1]:.2f} B/param")
    return Row(claim, verdict, head, fig(e), cmd(f"python experiments/convergence.py --experiment {e}"),
               _untuned_detail(R, e, model, about, state) + _compact(R, e, ("", "dropin/"), x_value=model) + " "
               + _ablation_arch(R, ablation_prefix)
               + ("" if _seeds_prefix(R, model) is None else " " + _many_seeds(R, model)))


def _untuned_detail(R, e, model, about, state):
    c = R.config(e)
    best = {r["variant"]: r["value"] for r in select(R.rows(e, "best_lr"), "best_lr")}
    adamw_lr = best["AdamW"]
    gefens = all(v == adamw_lr for k, v in best.items() if k.startswith("Gefen"))
    protocols = "so the two protocols coincide" if all(v == adamw_lr for v in best.values()) else "under both protocols"

    def med(v):
        return R.need(e, "val_loss_vs_adamw_median", v, x_value=model)

    share = next(v for v in variants_of(R, e, "val_loss_vs_adamw_median") if v.startswith("dropin/gefen-x@"))
    seeds = {b: R.values(e, "val_loss_vs_adamw", f"Gefen-{b}-factored", x_value=model) for b in ("8bit", "4bit")}
    gx_state = _state(R, e, "gefen-x")
    against = [f"the {b}-bit {'beats' if med(f'Gefen-{b}bit-factored') < med('gefen-x') else 'trails'} its loss at "
               f"{signed(s - gx_state)} B/param" for b, s in zip((8, 4), state)]
    kind = {k: _by_kind(R, model, "Gefen-8bit-factored", k) for k in ("matrix", "embedding", "vector")}
    gx_kind = [_by_kind(R, model, "gefen-x", k) for k in ("matrix", "embedding", "vector")]
    return (f"The {model} model ({about}), {c['steps']:,} steps, {len(c['seeds'])} seeds; AdamW's best lr of the grid is "
            f"{adamw_lr:g}" + (", every Gefen's too" if gefens else "") + f", {protocols}. Medians paired by seed "
            f"against AdamW: factored 8-bit {pct(med('Gefen-8bit-factored'))} ({pct_range(seeds['8bit'])}), 4-bit "
            f"{pct(med('Gefen-4bit-factored'))} ({pct_range(seeds['4bit'])}); the published 8-bit {pct(med('Gefen-8bit'))}, "
            f"torchao 8-bit {pct(med('torchao-AdamW8bit'))}, gefen-x {pct(med('gefen-x'))} at its own best lr "
            f"({best['gefen-x']:g}), {pct(med('dropin/gefen-x'))} at AdamW's and {pct(med(share))} at the "
            f"{_lr_share(share)} its README advises. State: {state[0]:.3f} / {state[1]:.3f} B/param (gefen-x "
            f"{gx_state:.3f}: {listed(against)}) against caps of {GEFEN_TARGET_BPP['Gefen-8bit-factored']:g} / "
            f"{GEFEN_TARGET_BPP['Gefen-4bit-factored']:g}: at width {c['n_embd']} the codes plus a v, a scale and a column "
            f"factor per row hold the matrices at {kind['matrix']:.3f} B/param, and the block rule keeps the embeddings "
            f"({kind['embedding']:.2f}) and vectors ({kind['vector']:.2f}) per element (section \"Gefen: optimizer "
            f"memory\", its seed; gefen-x {' / '.join(f'{x:.2f}' for x in gx_kind)}).")


def gefen_encoder(R):
    return _untuned(R, "convergence_encoder", "char-encoder-430k",
                    "… on a model it was not tuned on (pre-norm `nn.TransformerEncoderLayer`)",
                    "an encoder stack with the fused q/k/v `in_proj_weight` under a causal mask; the factored second "
                    "moment in square tiles of rows, q, k and v a column factor each, one v per element of a vector", "")


def gefen_llama(R):
    return _untuned(R, "convergence_llama", "char-llama-427k", "… on a Llama-style model",
                    "RMSNorm, SwiGLU, rotary positions, no biases, an untied head; the only tiles in the gate and up "
                    "projections", "char-llama-427k/")


def gefen_long(R):
    e, short, best = "convergence_long_lr", "convergence_encoder", "convergence_long"
    seeds = {r["seed"] for r in select(R.rows(e, "val_loss_vs_adamw"), "val_loss_vs_adamw")}
    long = [R.need(e, "val_loss_vs_adamw_median", f"dropin/Gefen-{b}-factored") for b in ("8bit", "4bit")]
    before = [median_over_seeds(R.rows(short, "val_loss_vs_adamw"), "val_loss_vs_adamw",
                                f"dropin/Gefen-{b}-factored", seeds) for b in ("8bit", "4bit")]
    if not all(math.isfinite(b) for b in before):
        raise ResultsError(f"{R.dir / short}.csv: no val_loss_vs_adamw of the factored Gefens' seeds {sorted(seeds)}")
    change = [_seed_change(R, e, short, f"dropin/Gefen-{b}-factored", seeds) for b in ("8bit", "4bit")]
    grew = [(a - b) * 100 for a, b in zip(long, before)]
    verdict = ("met" if not any(g > 0 for g in grew) else
               f"not met by the median: the factored gaps grow {' / '.join(signed(g) for g in grew)} points; "
               f"paired by seed {' / '.join(f'{signed(m)} ± {se:.2f}' for m, se in change)} (mean ± s.e.)")
    return Row(f"… and after {R.config(e)['steps']:,} steps (the encoder, drop-in, same lr)", verdict,
               f"8-bit {pct(long[0])} ({R.config(short)['steps']:,} steps: {pct(before[0])}), 4-bit {pct(long[1])} "
               f"({pct(before[1])}) vs AdamW",
               fig(e), cmd(f"python experiments/convergence.py --experiment {e}"),
               " ".join([_long_detail(R, e, short, best, seeds) + _compact(R, e, ("dropin/",)), _long_best(R)]))


def _seed_change(R, e, short, variant, seeds):
    """(mean, standard error) in points of ``variant``'s loss ratio in ``e`` less its ratio in
    ``short``, paired by seed over ``seeds``."""
    ratio = [{r["seed"]: r["value"] for r in select(R.rows(x, "val_loss_vs_adamw"), "val_loss_vs_adamw", variant)}
             for x in (e, short)]
    d = [(ratio[0][k] - ratio[1][k]) * 100 for k in sorted(seeds) if k in ratio[0] and k in ratio[1]]
    if len(d) < 2:
        raise ResultsError(f"{R.dir / e}.csv, {R.dir / short}.csv: fewer than two seeds of {variant} in both")
    return statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))


def _mean_se(xs) -> str:
    """"mean ± standard error" in points of loss ratios ``xs`` less 1."""
    d = [(x - 1) * 100 for x in xs]
    return f"{signed(statistics.fmean(d))} ± {statistics.stdev(d) / math.sqrt(len(d)):.2f}"


def _many_seeds(R, model):
    """The sentence on convergence model ``model``'s drop-in protocol at many seeds (SEEDS and its
    _fp32m run): each optimizer's median loss ratio and mean ± standard error over seeds, and the
    factored 8-bit's first moment in fp32 paired with its codes."""
    e, f, prefix = SEEDS, f"{SEEDS}_fp32m", _seeds_prefix(R, model)
    names = dict(zip(SEEDS_NAMES, ("factored 8-bit", "factored 4-bit")), **{"gefen-x": "gefen-x"})
    ratios = {v: R.values(e, "val_loss_vs_adamw", prefix + v) for v in names}
    fp32 = R.values(f, "val_loss_vs_adamw", prefix + "factored+fp32_m")
    codes = _paired(R, f, prefix + "factored", prefix + "factored+fp32_m")
    return (f"On {len(ratios['factored'])} seeds of {model}'s drop-in protocol (section \"{ABLATIONS_REPORT.title}\", the first "
            f"of them these runs'; median, then mean ± s.e. in points): "
            + ", ".join(f"{w} {pct(statistics.median(ratios[v]))} ({_mean_se(ratios[v])})" for v, w in names.items())
            + f"; the factored 8-bit with its first moment in fp32 {pct(statistics.median(fp32))} "
            f"({_mean_se(fp32)}), so its 8-bit codes cost {_mean_se([1 + d for d in codes])} points, paired by seed.")


TAIL = 3  # evaluations at the end of a run whose loss ratios a tail mean averages


def _tail_ratio(R, e, variant, seeds, base="dropin/AdamW"):
    """Median over ``seeds`` of ``variant``'s mean loss ratio to ``base`` over the run's last ``TAIL``
    evaluations, paired by seed and step: less sensitive than the final loss to one evaluation."""
    curves = {v: {} for v in (variant, base)}
    for v in curves:
        for r in select(R.rows(e, "val_loss"), "val_loss", v):
            if r["seed"] in seeds:
                curves[v].setdefault(r["seed"], {})[r["x_value"]] = r["value"]
    per_seed = []
    for k, own in curves[variant].items():
        steps = sorted(own)[-TAIL:]
        if len(steps) < TAIL or any(x not in curves[base].get(k, {}) for x in steps):
            raise ResultsError(f"{R.dir / e}.csv: no val_loss of {base} at {variant}'s last steps (seed {k})")
        per_seed.append(statistics.fmean(own[x] / curves[base][k][x] for x in steps))
    if not per_seed:
        raise ResultsError(f"{R.dir / e}.csv: no val_loss of {variant}")
    return statistics.median(per_seed)


def _long_detail(R, e, short, best, seeds):
    names = ["dropin/Gefen-8bit-factored", "dropin/Gefen-4bit-factored", "dropin/gefen-x"]
    share = next(v for v in variants_of(R, e, "val_loss_vs_adamw_median") if v.startswith("dropin/gefen-x@"))

    def per_seed(x, v):
        """{seed: loss ratio} of variant ``v`` in experiment ``x``, on this run's seeds."""
        return {r["seed"]: r["value"] for r in select(R.rows(x, "val_loss_vs_adamw"), "val_loss_vs_adamw", v)
                if r["seed"] in seeds}

    def med(x, v):
        return statistics.median(per_seed(x, v).values())

    def mean(x, v):
        return statistics.fmean(per_seed(x, v).values())

    now = {v: med(e, v) for v in names + [share]}
    then = {v: med(short, v) for v in names}
    hi = {v: med(best, v) for v in names + [share]}
    long8, short8 = per_seed(e, names[0]), per_seed(short, names[0])
    worse = sum(long8[s] > short8[s] for s in long8 if s in short8)
    grid = R.config(best)["lrs"]
    sweep = {r["x_value"]: r["value"] for r in select(R.rows(best, "lr_sweep_val_loss"), "lr_sweep_val_loss", "dropin/AdamW")}
    top = R.need(best, "best_lr", "dropin/AdamW")
    fixed_lr = R.config(e)["lrs"][0]
    near = sweep[fixed_lr] / sweep[top] - 1 if fixed_lr in sweep and top in sweep else math.nan
    steps = (R.config(e)["steps"], R.config(short)["steps"])
    words = ("factored 8-bit", "4-bit", "gefen-x")  # of names
    return (f"The encoder {steps[0] // steps[1]}× as long, {len(seeds)} seeds, drop-in protocol, twice: at AdamW's best "
            f"lr of {' / '.join(f'{x:g}' for x in grid)} ({top:g}" + (", the grid's top" if top == max(grid) else "")
            + f"; {fixed_lr:g} within {near:.2%}), and at the {steps[1]:,}-step run's lr, {fixed_lr:g}, held fixed, so "
            f"that length alone changes. Medians paired by seed against the same seeds at {steps[1]:,} steps: at "
            f"{fixed_lr:g}, factored 8-bit {pct(now[names[0]])} (from {pct(then[names[0]])}; {pct_range(long8.values())}, "
            f"{worse} of {len(long8)} seeds worse), 4-bit {pct(now[names[1]])} (from {pct(then[names[1]])}), gefen-x "
            f"{pct(now[names[2]])} (from {pct(then[names[2]])}; {pct_range(per_seed(e, names[2]).values())}), gefen-x at "
            f"{_lr_share(share)} {pct(now[share])}; at {top:g}, factored 8-bit {pct(hi[names[0]])}, 4-bit "
            f"{pct(hi[names[1]])}, gefen-x {pct(hi[names[2]])}, at {_lr_share(share)} {pct(hi[share])}. So at an "
            f"unchanged lr the factored gaps move by {points(now[names[0]], then[names[0]])} (8-bit) and "
            f"{points(now[names[1]], then[names[1]])} (4-bit) with training, and gefen-x's by "
            f"{points(now[names[2]], then[names[2]])}; the means at {fixed_lr:g} are {pct(mean(e, names[2]))} (gefen-x) "
            f"and {pct(mean(e, names[0]))} (factored 8-bit), within {len(seeds)} seeds' spread. Paired by seed, the "
            f"change from {steps[1]:,} to {steps[0]:,} steps (mean ± standard error, points): "
            + ", ".join(f"{w} {signed(m)} ± {se:.2f}"
                        for w, (m, se) in zip(words, (_seed_change(R, e, short, v, seeds) for v in names)))
            + f". Averaged over each run's last {TAIL} evaluations ({R.config(e)['eval_every']} steps apart) "
            "instead of the final one, the medians are " + ", ".join(
                f"{w} {pct(_tail_ratio(R, e, v, seeds))} (from {pct(_tail_ratio(R, short, v, seeds))})"
                for w, v in zip(words, names)) + ". State "
            f"{_state(R, e, names[0]):.3f} / {_state(R, e, names[1]):.3f} B/param (gefen-x {_state(R, e, names[2]):.3f}).")


def gefen_bf16(R):
    e = "convergence_bf16"
    ours = R.need(e, "val_loss_vs_adamw_median", "Gefen-8bit-factored+bf16-sr")
    published = R.need(e, "val_loss_vs_adamw_median", "Gefen-8bit+bf16-sr")
    ok = [x - 1 <= BF16_TARGET for x in (ours, published)]
    verdict = (("holds for the factored 8-bit" if ok[0] else "not met for the factored 8-bit")
               + ("; holds for the published 8-bit" if ok[1] else "; not for the published 8-bit")
               + f" (target {BF16_TARGET:+.1%})")
    c = R.config(e)
    detail = (f"Medians over {len(c['seeds'])} seeds, {c['steps']:,} steps, each optimizer at its best lr of a grid, "
              f"against fp32 AdamW: plain bf16 AdamW (no fp32 copy, no stochastic rounding) "
              f"{pct(R.need(e, 'val_loss_vs_adamw_median', 'AdamW+bf16'))}, the factored 8-bit on fp32 weights "
              f"{pct(R.need(e, 'val_loss_vs_adamw_median', 'Gefen-8bit-factored'))}.")
    return Row("Gefen on bf16 weights, no fp32 copy (stochastic rounding, ours)", verdict,
               f"factored 8-bit {pct(ours)}, published 8-bit {pct(published)} vs fp32 AdamW's loss "
               f"({MODELS.get(c['model_label'], c['model_label'])} model)",
               fig(e), cmd(f"python experiments/convergence.py --experiment {e}"), detail)


def gefen_codebook(R):
    e = "codebook_dp"
    rows = R.rows(e, "cost_rel_diff_vs_upstream", codebook.SPEED)
    top = codebook.fastest(rows)
    numpy = R.need(e, codebook.SPEED, top["variant"].replace("numba", "numpy"), x_value=top["bins"])
    detail = (f"Upstream's optimum to {sci(top['diff'])} (relative cost) at every size measured; the numpy path "
              f"{times(numpy, 0)} upstream's speed at the same size (speeds: upstream's CPU time / ours). The section "
              "adds the codebooks' quantisation error against absmax and dynamic codes.")
    return Row("Gefen's codebook DP is exact", "reproduced, faster" if top["diff"] < 1e-6 else "not met",
               codebook.headline(rows), fig("codebook"), cmd(f"python experiments/{e}.py"), detail)


def gefen_speed(R):
    from experiments.gefen_speed import SMALL_TENSORS  # the small-tensor model's count of tensors

    e = "gefen_speed"
    rows = R.rows(e, "step_time_vs_adamw", "launches_per_step")
    ours = ("Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored", "Gefen-4bit-factored")

    def speeds(model, names=ours):
        return [1 / R.need(e, "step_time_vs_adamw", f"{model}/{n}", x_value=THREADS) for n in names]

    large = speeds("transformer") + speeds("mlp")
    small = speeds("small-tensors")
    launches = [r["value"] for r in select(rows, "launches_per_step") if r["variant"] in ours]
    parts = [("met" if min(large) >= TARGET_CPU else "not met") + " on CPU for large tensors",
             ("met" if min(small) >= TARGET_SMALL else "not met") + " for many small tensors",
             ("met" if max(launches) <= LAUNCH_TARGET else "not met") + " for the Triton path's launches"]
    peers = {p: [s for m in ("transformer", "mlp", "small-tensors") for s in speeds(m, (p,))]
             for p in ("torchao-AdamW8bit", "gefen-x")}
    counted = {m: [r["value"] for r in select(R.rows(e, m), m) if r["variant"] in ours]
               for m in ("device_ops_per_step", "host_syncs_per_step")}
    counts = sorted({r["x_value"] for r in select(rows, "launches_per_step") if r["variant"] in ours})
    detail = (f"{THREADS:g} thread: {span(large)} fused AdamW's speed on the transformer and MLP (8/4-bit, factored), "
              f"{span(small)} on {SMALL_TENSORS} small tensors; torchao 8-bit {span(peers['torchao-AdamW8bit'], 3)}, gefen-x "
              f"{span(peers['gefen-x'], 3)}. The Triton path issues {max(counted['device_ops_per_step']):g} torch device "
              f"operations, {max(counted['host_syncs_per_step']):g} host synchronisations and "
              f"{min(launches):g}–{max(launches):g} launches a step after the first, at "
              f"{listed(f'{c:g}' for c in counts)} tensors alike. The GPU timing of the step plan is not in these "
              "results (`bash experiments/gpu_checks.sh` measures it).")
    target = f"≥ {TARGET_CPU:g}×" + ("" if TARGET_SMALL == TARGET_CPU else f" (small tensors ≥ {TARGET_SMALL:g}×)")
    return Row(f"Gefen's step at the speed of its bytes (CPU: {target} fused AdamW's speed; Triton: ≤ {LAUNCH_TARGET} launches)",
               "; ".join(parts),
               f"{THREADS:g} thread: {span(large)} fused AdamW on large tensors, {span(small)} on {SMALL_TENSORS} small ones; "
               f"Triton path {min(launches):g}–{max(launches):g} launches a step", fig(e), cmd(f"python experiments/{e}.py"),
               detail)


def gefen_peak_memory(R):
    e, b = "gefen_peak_memory", "gefen_budgets"
    rows, budgets = R.rows(e, "tensor_peak_per_param"), R.rows(b, "largest_micro_batch")
    lean = peak_memory.LEAN

    def peak(name, pick=max):  # max: the last step, steady state; min: the first
        return R.at_end(e, "tensor_peak_per_param", "mlp-50.4M/mb8/" + name, pick)["value"]

    targets = peak_memory.claim_targets(rows, budgets)
    missed = [f"{words} {by}" for words, met, _, by in targets if not met]
    verdict = f"holds on {len(targets) - len(missed)} of {len(targets)} targets" + (
        f"; misses {'; '.join(missed)}" if missed else "")
    mb = peak_memory.micro_batches(budgets)
    detail = ("Targets: " + "; ".join(f"{words}: {'met' if met else 'missed'} ({what})" for words, met, what, _ in targets)
              + ". The lowest peak is judged at every step of every model and micro-batch, the lean mode's bytes at "
              "every step of each model at its first micro-batch (the figure's panels).")
    return Row("Gefen has the lowest peak memory and trains larger micro-batches", verdict,
               f"peak 8-bit {peak('Gefen-8bit'):.1f}, lean mode {peak(lean):.1f} (its first step {peak(lean, min):.1f}), "
               f"fused AdamW {peak('AdamW'):.1f} B/param (50.4M MLP); micro-batch in {peak_memory.MB_BUDGET_GIB:g} GiB: "
               f"lean {mb['lean']:g}, AdamW {mb['AdamW']:g}", fig(e), cmd(f"python experiments/{e}.py"), detail)


def gefen_hessian(R):
    e = "hessian_alignment"
    rows = R.rows(e, "spearman_spread", "coupling_within", "val_loss")
    rho = max(abs(r["value"]) for r in select(rows, "spearman_spread"))
    models = sorted({r["variant"] for r in select(rows, "spearman_spread")})

    def last(metric, variant):
        return R.at_end(e, metric, variant)["value"]

    s2 = all(last("coupling_within", f"{m}/gefen") > last("coupling_within", f"{m}/random_gefen") for m in models)
    gap = {k: max(R.need(e, "val_loss", f"{m}/{k}") - R.need(e, "val_loss", f"{m}/adamw") for m in models)
           for k in ("gefen", "random_gefen")}
    s3 = gap["gefen"] <= S3_NATS
    words = ["not reproduced" if rho < S1_RHO else "reproduced", "reproduced" if s2 else "not reproduced",
             "reproduced" if s3 else "not reproduced"]
    if s3 and gap["random_gefen"] <= S3_NATS:
        words[2] += ", but random blocks of the same sizes do as well"
    m0 = models[-1]
    c = R.config(e)
    detail = (f"On a small {listed(models)} ({c['steps']} steps, {c['checkpoints']} checkpoints). S1: |Spearman "
              f"ρ(coupling, spread)| at most {rho:.2f} at every checkpoint, below the {S1_RHO:g} that would show a "
              f"correlation. S2: within-block coupling {last('coupling_within', m0 + '/gefen'):.2f} for Gefen's blocks "
              f"against {last('coupling_within', m0 + '/random_gefen'):.2f} for random blocks of the same sizes ({m0}). "
              f"S3: the final loss of Gefen's blocks is at most {gap['gefen']:+.3f} nats from AdamW's, of random blocks "
              f"{gap['random_gefen']:+.3f} (a tie is within {S3_NATS:g}); means over seeds.")
    return Row("Blocks follow Hessian coupling (S1 / S2 / S3)", " / ".join(words),
               f"S1: largest \\|Spearman ρ\\| {rho:.2f}; S2: within-block coupling {last('coupling_within', m0 + '/gefen'):.2f} "
               f"vs random {last('coupling_within', m0 + '/random_gefen'):.2f} ({m0})", fig(e), cmd(f"python experiments/{e}.py"),
               detail)


def _junit(path) -> dict:
    """Passed, failed and skipped counts of a pytest JUnit XML file."""
    import xml.etree.ElementTree as ET

    try:
        suites = ET.parse(path).getroot().iter("testsuite")
    except (OSError, ET.ParseError) as exc:
        raise ResultsError(f"{path}: not a test report ({exc})") from None
    n = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in n:
            n[k] += int(s.get(k, 0))
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"] + n["errors"],
            "skipped": n["skipped"]}


def gefen_gpu(R):
    g, k = "gpu/gefen_kernels", "kernel_resources"
    rows = select(R.rows(g, "speedup_vs_AdamW"), "speedup_vs_AdamW", "Gefen-8bit/fp32")
    sizes = sorted({r["x_value"] for r in rows}, key=float)
    if not sizes:
        raise ResultsError(f"{R.dir / g}.csv: no speedup_vs_AdamW of Gefen-8bit/fp32")
    step = [R.need(g, "speedup_vs_AdamW", "Gefen-8bit/fp32", x_value=s) for s in sizes]
    kernel = [R.need(g, "speedup_vs_AdamW", "Gefen-8bit/kernel/fp32", x_value=s) for s in sizes]
    label = " / ".join(f"{float(s) / 1e9:.2g}B" if float(s) >= 1e9 else f"{float(s) / 1e6:.0f}M" for s in sizes)

    def need(m, v):
        return [R.need(g, m, v, x_value=s) for s in sizes]

    ms = {v: need("step_time", v) for v in ("Gefen-8bit/fp32", "AdamW/fp32", "Gefen-8bit/kernel/fp32")}
    ours_f, adam_f = need("frac_of_copy", "Gefen-8bit/kernel/fp32"), need("frac_of_copy", "AdamW/fp32")
    floor = [R.need(g, "floor_bytes", "Gefen-8bit/fp32", x_value=s) / R.need(g, "floor_bytes", "AdamW/fp32", x_value=s)
             for s in sizes]
    around = [(a - b) / b for a, b in zip(ms["Gefen-8bit/fp32"], ms["Gefen-8bit/kernel/fp32"])]
    predicted = {d: max(r["value"] for r in select(R.rows(k, "time_vs_AdamW"), "time_vs_AdamW")
                        if r["variant"].startswith(f"predicted/Gefen-8bit/{d}/")) for d in ("fp32", "bf16")}
    copy = R.values(g, "bandwidth", "copy")[0]
    c = R.config(g)
    tests = _junit(R.dir / "gpu" / "kernel_tests.xml")
    moves = _junit(R.dir / "gpu" / "device_moves.xml")
    detail = (f"`Gefen.step()` against fused AdamW's step, median of {c['reps']} steps: "
              f"{' / '.join(f'{a:.1f} vs {b:.2f} ms' for a, b in zip(ms['Gefen-8bit/fp32'], ms['AdamW/fp32']))} at "
              f"{label} fp32 parameters ({joined(step, times)} AdamW's speed); bf16 parameters "
              f"{joined(need('speedup_vs_AdamW', 'Gefen-8bit/bf16'), times)}. The kernel alone (launch tables built once, the "
              f"`/kernel` variants) runs at {joined(kernel, times)} AdamW's speed in fp32, "
              f"{joined(need('speedup_vs_AdamW', 'Gefen-8bit/kernel/bf16'), times)} in bf16, at {min(ours_f):.0%}–{max(ours_f):.0%} "
              f"of the device's copy bandwidth in fp32 ({copy / 1e3:.1f} TB/s measured) where fused AdamW reaches "
              f"{min(adam_f):.0%}–{max(adam_f):.0%}. So the prediction from the compiled kernels and a traffic model "
              f"({predicted['fp32']:.2f} times AdamW's step time in fp32, {predicted['bf16']:.2f} in bf16: section "
              "\"Triton kernels\") is not met: the kernel moves "
              f"{min(floor):.2f} of AdamW's bytes but does not reach the bandwidth AdamW does, and the optimizer's work "
              f"around the kernel (per step, on the host and in extra device passes) costs {min(around):.1f}–"
              f"{max(around):.1f} times the kernel's time. The kernel tests on the GPU (`results/gpu/kernel_tests.xml`): "
              f"{tests['passed']} passed, {tests['failed']} failed; parameters moved to the GPU after the optimizer was "
              "built (DSA staged and direct, the ball, Gefen) train as SparseAdam and AdamW built there "
              f"(`device_moves.xml`: {moves['passed']} passed, {moves['failed']} failed). `bash "
              "experiments/gpu_checks.sh [DIR]` runs every GPU check on one GPU, each step time-limited (what it runs: "
              "[docs/DESIGN.md](../docs/DESIGN.md)); both benchmarks also run on the CPU with `--dry-run` (in the tests).")
    return Row("Gefen's Triton step on a GPU at fused AdamW's speed", "met (one H200)" if min(step) >= 1 else "not met (one H200)",
               f"step {' / '.join(times(s) for s in step)} fused AdamW ({label} fp32); kernel alone "
               f"{' / '.join(times(k) for k in kernel)}", "—", cmd("bash experiments/gpu_checks.sh"), detail)


COMPACT_TARGET = {"8bit": 1.06, "4bit": 0.56}  # the compact layout's bytes at width >= 128
WIDE = TARGET_WIDTH  # the width from which COMPACT_TARGET holds


def _total_bytes(R, label, name):
    """State bytes per parameter of optimizer ``name`` on convergence model ``label``: gefen_memory's
    bytes by kind weighted by each kind's parameters ("shared" over the model)."""
    e, kinds = "gefen_memory", ("matrix", "embedding", "vector", "shared")
    counts = {k: R.need(e, "params_of_kind", f"{label}/{name}", x_value=k) for k in kinds}
    n = sum(counts[k] for k in kinds[:3])
    return sum(_by_kind(R, label, name, k) * (counts[k] if k != "shared" else n) for k in kinds) / n


# each layout option alone on the factor: (experiment, variant, words)
LAYOUT_ALONE = [("gefen_ablation_layout", "factored+scale_rows", "row-group scales"),
                ("gefen_ablation_column", "factored+whole_w", "one column factor a matrix"),
                ("gefen_ablation_vectors", "factored+vec_v", "v shared on vectors"),
                ("gefen_ablation_vectors", "factored+rows_v", "v over whole rows of rule-less matrices")]


def _paired(R, e, variant, base="factored"):
    """The loss ratio of ``variant`` less ``base``'s, seed by seed, in experiment ``e``."""
    seeds = {v: {r["seed"]: r["value"] for r in select(R.rows(e, "val_loss_vs_adamw"), "val_loss_vs_adamw", v)}
             for v in (base, variant)}
    if not seeds[base] or seeds[base].keys() != seeds[variant].keys():
        raise ResultsError(f"{R.dir / e}.csv: no seed-paired val_loss_vs_adamw of {base} and {variant}")
    return [seeds[variant][k] - seeds[base][k] for k in sorted(seeds[base])]


def _four_bit_scales(R):
    """The sentence on the row-group scales under 4-bit codes (gefen_ablation_4bit): each variant's
    median loss ratio and the 512-element layout paired with the 2,048-element one."""
    e = "gefen_ablation_4bit"
    names = {"factored": "factored", "factored+scale_rows": "row-group scales of 2,048 elements",
             "factored+scale_rows512": "of 512", "factored+layout": "the layout with 2,048",
             "factored+layout512": "with 512 (Gefen-4bit-compact's)"}
    med = {v: statistics.median(r["value"] for r in select(R.rows(e, "val_loss_vs_adamw"), "val_loss_vs_adamw", v))
           for v in names}
    short = [a - b for a, b in zip(_paired(R, e, "factored+layout512"),
                                   _paired(R, e, "factored+layout"))]
    return (f"Under 4-bit codes (encoder, {R.config(e)['steps']:,} steps, median over {len(short)} seeds): "
            + ", ".join(f"{w} {pct(med[v])}" for v, w in names.items())
            + f"; the 512-element layout paired with the 2,048 one {pct(1 + statistics.fmean(short))} on the mean "
            f"(better on {sum(d < 0 for d in short)} of {len(short)}).")


def _codebook_refresh(R):
    """The sentence on the codebook learned again under 4-bit codes (gefen_ablation_refresh): each
    layout's median loss ratio without and with it, and the change paired by seed."""
    e = "gefen_ablation_refresh"
    parts = [f"{words} {_before_after(R, e, base, new)}"
             for words, base, new in (("factored", "factored", "factored+refresh"),
                                      ("compact (512-element scales)", "factored+layout512",
                                       "factored+layout512_refresh"))]
    return (f"With the codebook learned again every {REFRESH_EVERY} steps "
            f"(`codebook_refresh_every`; encoder, 4-bit codes, {R.config(e)['steps']:,} steps, median over "
            f"{len(R.values(e, 'val_loss_vs_adamw', 'factored'))} seeds): " + "; ".join(parts) + ".")


def _before_after(R, e, base, new):
    """``base``'s median loss ratio -> ``new``'s in experiment ``e``, and their difference paired by
    seed: its mean and on how many seeds ``new`` is better."""
    rows = R.rows(e, "val_loss_vs_adamw")
    d = _paired(R, e, new, base)
    before, after = (median_over_seeds(rows, "val_loss_vs_adamw", v) for v in (base, new))
    return (f"{pct(before)} -> {pct(after)} "
            f"(paired {pct(1 + statistics.fmean(d))} on the mean, better on {sum(x < 0 for x in d)} of {len(d)})")


def _refresh_models(R):
    """The sentence on the codebook learned again under 4-bit codes on every convergence configuration
    (gefen_ablation_refresh_models): per model the factored 4-bit's median without and with it."""
    e = "gefen_ablation_refresh_models"
    c = R.config(e)
    labels = [c["label"], *c["extra"]]
    prefixes = ["", *(f"{m}/" for m in labels[1:])]
    return (f"The same on the {len(labels)} convergence configurations, each at its steps and AdamW's best lr "
            f"there (factored 4-bit, median over {len(R.values(e, 'val_loss_vs_adamw', 'factored'))} seeds): "
            + "; ".join(f"{m} {_before_after(R, e, p + 'factored', p + 'factored+refresh')}"
                        for m, p in zip(labels, prefixes)) + ".")


def _medians_and_pairs(R, e, intro, names, pairs, option=""):
    """One sentence on an ablation ``e`` of the encoder: ``intro`` (``option``: the keyword it names),
    its code width, steps and lr, each variant's median loss ratio (``names``: variant -> words) and,
    paired by seed, the mean difference of each of ``pairs`` ((words, variant, base))."""
    rows = R.rows(e, "val_loss_vs_adamw")
    med = {v: median_over_seeds(rows, "val_loss_vs_adamw", v) for v in names}
    diffs = [(words, _paired(R, e, new, base)) for words, new, base in pairs]
    c = R.config(e)
    return (f"{intro} ({option + '; ' if option else ''}encoder, {c.get('bits') or 8}-bit codes, {c['steps']:,} steps, "
            f"lr {c['lr']:g}, median over {len(diffs[0][1])} seeds): "
            + ", ".join(f"{w} {pct(med[v])}" for v, w in names.items()) + "; paired by seed, "
            + "; ".join(f"{w} {pct(1 + statistics.fmean(d))} on the mean (better on {sum(x < 0 for x in d)} of {len(d)})"
                        for w, d in diffs) + ".")


# the compact layout's four options (experiments/gefen_ablation.py's LAYOUT_OPTIONS), as words
_OPTIONS = (("vec_v", "the vectors' shared v"), ("rows_v", "whole-row v"), ("scale_rows", "row-group scales"),
            ("whole_w", "one column factor a matrix"))
_VECTORS4 = {"factored": "factored", "factored+vec_v": "the vectors' v shared", "factored+rows_v": "whole-row v"}
# the sentences on the compact layout's options under 4-bit codes, one an ablation:
# experiment -> (intro, {variant: words}, [(words, variant, base) paired by seed], the option's keyword)
FOUR_BIT_SENTENCES = {
    "gefen_ablation_factor16": (
        "Column factors per square tile in bf16, rounded stochastically",
        {"factored": "factored", "factored+w16": "its factors in bf16",
         "factored+layout512": "compact (one column factor a matrix)", "factored+layout512_tiles": "compact with one a tile",
         "factored+layout512_w16": "the same in bf16"},
        [("bf16 against fp32 factors", "factored+w16", "factored"),
         ("compact with bf16 factors a tile against one a matrix", "factored+layout512_w16", "factored+layout512"),
         ("against fp32 factors a tile", "factored+layout512_w16", "factored+layout512_tiles")],
        "`factor_dtype`"),
    "gefen_ablation_vectors4": (
        "The compact layout's two v options, each alone", _VECTORS4,
        [(w, v, "factored") for v, w in _VECTORS4.items() if v != "factored"], ""),
    "gefen_ablation_scales4": (
        "Row-group scales of at most 256 elements",
        {"factored": "factored", "factored+layout512": "compact (512-element scales)",
         "factored+scale_rows256": "256-element scales alone", "factored+layout256": "compact with 256",
         "factored+layout256_w16": "the same, its column factor in bf16"},
        [("256-element scales alone against the factored", "factored+scale_rows256", "factored"),
         ("compact with 256 against 512", "factored+layout256", "factored+layout512"),
         ("its factor in bf16 against fp32", "factored+layout256_w16", "factored+layout256")],
        "`row_group_scales=256`"),
    "gefen_ablation_leave_out4": (
        "The compact 4-bit layout with one of its options left out",
        {"factored": "factored", "factored+layout512": "compact",
         **{f"factored+layout512_no_{o}": f"without {w}" for o, w in _OPTIONS}},
        [(f"without {w} against compact", f"factored+layout512_no_{o}", "factored+layout512") for o, w in _OPTIONS],
        ""),
}


def _long_best(R):
    """The sentence on the factored 8-bit at 3,000 steps and AdamW's best lr there
    (gefen_ablation_long_best): the factor alone, its first moment in fp32, the codebook learned
    again, the compact layout, gefen-x."""
    names = {"factored": "factored 8-bit", "factored+fp32_m": "its first moment in fp32",
             "factored+refresh": f"the codebook learned again every {REFRESH_EVERY} steps",
             "factored+layout": "compact", "gefen-x": "gefen-x"}
    return _medians_and_pairs(
        R, "gefen_ablation_long_best", "The same length at AdamW's best lr there, with one change each", names,
        [(f"{w} against the factored", v, "factored") for v, w in names.items() if v != "factored"])


def gefen_layout(R):
    e = "gefen_ablation_layout"
    labels = [v.removesuffix("/gefen-x") for v in variants_of(R, "gefen_memory", "state_bytes_per_param_of_kind")
              if v.endswith("/gefen-x")]
    per = {b: [_total_bytes(R, m, f"Gefen-{b}-compact") for m in labels] for b in ("8bit", "4bit")}
    gx = [_total_bytes(R, m, "gefen-x") for m in labels]
    wide = [k for k, m in enumerate(labels) if R.config("gefen_memory")["widths"][m] >= WIDE]
    fewer = all(a <= x for a, x in zip(per["8bit"], gx))
    under = all(per[b][k] <= COMPACT_TARGET[b] for b in per for k in wide)
    seeds = {v: {r["seed"]: r["value"] for r in select(R.rows(e, "val_loss_vs_adamw"), "val_loss_vs_adamw", v)}
             for v in ("factored", "factored+layout", "factored+scale_rows")}
    if not all(seeds.values()):
        raise ResultsError(f"{R.dir / e}.csv: no val_loss_vs_adamw of {[v for v, x in seeds.items() if not x]}")
    med = {v: statistics.median(x.values()) for v, x in seeds.items()}
    paired = {v: [x[s] - seeds["factored"][s] for s in sorted(x)] for v, x in seeds.items() if v != "factored"}
    worse = sum(d > 0 for d in paired["factored+layout"])
    level = med["factored+layout"] <= med["factored"]
    verdict = (f"{'bytes met' if fewer and under else 'bytes not met'}; loss "
               f"{'level by the median' if level else 'worse by the median'}, worse on {worse} of "
               f"{len(paired['factored+layout'])} seeds")
    detail = (f"State bytes per parameter after one step ({', '.join(labels)}): compact 8-bit "
              f"{joined(per['8bit'], lambda x: f'{x:.3f}')}, 4-bit {joined(per['4bit'], lambda x: f'{x:.3f}')}; gefen-x "
              f"{joined(gx, lambda x: f'{x:.3f}')} (targets at width >= {WIDE}: {COMPACT_TARGET['8bit']} / "
              f"{COMPACT_TARGET['4bit']}, and no more than gefen-x's). Loss / AdamW's on the encoder at "
              f"{R.config(e)['steps']:,} steps, lr {R.config(e)['lr']:g} held fixed, median over "
              f"{len(seeds['factored'])} seeds: factored 8-bit {pct(med['factored'])}, compact "
              f"{pct(med['factored+layout'])} (paired with the factored by seed: "
              f"{pct(1 + statistics.fmean(paired['factored+layout']))} on the mean), the row-group scales alone "
              f"{pct(med['factored+scale_rows'])}; gefen-x at these settings and seeds is in gefen_ablation_long's "
              "section. Each option alone on the factor, paired with the factored by seed (mean; worse on): "
              + "; ".join(f"{words} {pct(1 + statistics.fmean(d))} ({sum(x > 0 for x in d)} of {len(d)})"
                          for words, d in ((w, _paired(R, x, v)) for x, v, w in LAYOUT_ALONE)) + ". "
              + " ".join([_four_bit_scales(R), _codebook_refresh(R), _refresh_models(R),
                          *(_medians_and_pairs(R, x, *spec) for x, spec in FOUR_BIT_SENTENCES.items())]))
    lo, hi = (f(per["8bit"][k] for k in wide) for f in (min, max))
    return Row("The factored state at Gefen-X's bytes or fewer (compact layout, ours)", verdict,
               f"8-bit {lo:.3f}–{hi:.3f} B/param at width ≥ {WIDE}, ≤ gefen-x's on "
               f"{sum(a <= x for a, x in zip(per['8bit'], gx))} of {len(gx)} models; loss {pct(med['factored+layout'])} "
               f"(factored {pct(med['factored'])}; encoder, {R.config(e)['steps']:,} steps)", fig("gefen_ablation"),
               cmd(f"python experiments/gefen_ablation.py --ablation {e}"), detail)


ROWS = [gefen_memory, gefen_quality, gefen_ablation, gefen_factored, gefen_encoder, gefen_llama, gefen_long,
        gefen_layout, gefen_bf16, gefen_codebook, gefen_speed, gefen_peak_memory, gefen_hessian, gefen_gpu]
