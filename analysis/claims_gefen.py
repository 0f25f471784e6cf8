"""The claims table's rows of Gefen (``analysis/claims.py``), one function a row."""

from __future__ import annotations

import math
import statistics

from analysis.common import GEFEN_TARGET_BPP, TARGET_WIDTH, ResultsError, measured_before_grouped, select, value
from analysis import codebook, convergence
from analysis import gefen_ablation as ablations
from analysis import gefen_memory as memory
from analysis import gefen_peak_memory as peak_memory
from analysis.gefen_memory import TARGET_FACTORED_STEP
from analysis.gefen_speed import ADAMW_PEERS, HEADLINE_GEFENS, TARGET_CPU, TARGET_SMALL
from analysis.claims_common import (TAIL, Row, cmd, fig, joined, junit_counts, listed, median_over_seeds, pct,
                                   pct_range, points, sci, seed_change, signed, span, tail_ratio, times)

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
    e, model = "gefen_ablation", next(iter(MODELS))
    every, shared = (ablation_row(R, e, v, model).median for v in ("all", "none"))
    return Row("… the gap is the shared second moment", "found here",
               f"v per element everywhere: {pct(every)} vs AdamW's loss (shared v: {pct(shared)}; {MODELS[model]} model)",
               fig(e), cmd(f"python experiments/{e}.py"), ablations_text(R, "gefen_ablation"))


# ------------------------------------------------------------------------------ the ablations' numbers
SEEDS_ABLATIONS = (convergence.SEEDS, f"{convergence.SEEDS}_fp32m")  # the drop-in protocol on many seeds
# the compact layout of today against the factored one: the encoder on 15 seeds, then the other four models
COMPACT_RUNS = ("gefen_ablation_candidates", "gefen_ablation_candidates_models")
BOUND_RUN = "gefen_ablation_bound"  # the layouts with and without the first-moment bound, five models
# the ablations (experiments/gefen_ablation.py's ABLATIONS) each row's detail quotes:
# row -> [(ablation, the model label it quotes, or None: every model the ablation ran)]
RESTS_ON = {
    "gefen_ablation": [("gefen_ablation", None)],
    "gefen_factored": [(a, "char-gpt-116k") for a in SEEDS_ABLATIONS],
    "gefen_encoder": [(a, "char-encoder-430k") for a in ("gefen_ablation_arch", *SEEDS_ABLATIONS)],
    "gefen_llama": [("gefen_ablation_arch", "char-llama-427k")],
    "gefen_long": [("gefen_ablation_long", None), ("gefen_ablation_long_best", None)],
    "gefen_layout": [(a, None) for a in (
        "gefen_ablation_layout", "gefen_ablation_column", "gefen_ablation_vectors", "gefen_ablation_4bit",
        "gefen_ablation_refresh", "gefen_ablation_refresh_models", "gefen_ablation_factor16", "gefen_ablation_vectors4",
        "gefen_ablation_scales4", "gefen_ablation_leave_out4", "gefen_ablation_leave_out", *COMPACT_RUNS,
        "gefen_ablation_candidates_long")],
}


def ablation_summary(R, name, model=None) -> list:
    """The summary rows (analysis/gefen_ablation.py's ``SummaryRow``s) of ablation ``name``, of ``model``
    only where given; at least one."""
    rows = R.rows(name, ablations.METRIC)  # read first: the row's section in the index is its first read's
    memory = R.rows(ablations.MEMORY, "state_bytes_per_param_of_kind", "params_of_kind")
    out = [s for s in ablations.summarise({name: rows}, memory, {"config": R.config(ablations.FIRST)})
           if model in (None, s.model)]
    if not out:
        raise ResultsError(f"{R.dir / name}.csv: no {ablations.METRIC} of model {model}; "
                           f"rerun python experiments/gefen_ablation.py --ablation {name}")
    return out


def ablation_row(R, name, variant, model=None):
    """The summary row of ``variant`` in ablation ``name`` (its first model, or ``model``)."""
    rows = ablation_summary(R, name, model)
    row = next((s for s in rows if s.variant == variant and s.model == rows[0].model), None)
    if row is None:
        raise ResultsError(f"{R.dir / name}.csv: no {ablations.METRIC} of {variant}; "
                           f"rerun python experiments/gefen_ablation.py --ablation {name}")
    return row


def _seeds_count(R, model) -> int:
    """How many seeds the drop-in protocol on many seeds ran ``model`` on."""
    return ablation_row(R, convergence.SEEDS, "factored", model).seeds


def ablations_text(R, row) -> str:
    """The ablations claims row ``row`` (a function's name) rests on (``RESTS_ON``), a sentence each."""
    return ("From the ablations (a variant's loss over AdamW's, median over seeds; in brackets its change against "
            "the reference paired by seed, mean ± s.e. in points, and a named layout's state B/param): "
            + " ".join(ablations.sentence(ablation_summary(R, name, model)) for name, model in RESTS_ON[row]))


def _factored(R, e, model, prefix=""):
    """(8-bit, 4-bit) loss ratios of the factored layout (``convergence.factored_loss``, the figure's
    numbers) and its mean state B/param."""
    seeds = R.rows(convergence.SEEDS, "val_loss_vs_adamw") if convergence.seeds_prefix(model) is not None else None
    loss = convergence.factored_loss(R.rows(e, "val_loss_vs_adamw_median"), model, prefix, seeds)
    return loss, [_state(R, e, prefix + f"Gefen-{b}-factored") for b in ("8bit", "4bit")]


def _state(R, e, variant):
    """Mean state bytes per parameter of ``variant`` over its seeds."""
    return statistics.fmean(R.values(e, "state_bytes_per_param", variant))


def _compact(R, e, protocols, **where) -> str:
    """The sentence on Gefen-X's-bytes layout (``layout="compact"``) in convergence experiment ``e``:
    each width's median loss ratio, the worst of ``protocols`` (variant prefixes), and its mean state; empty
    where the run has no compact rows."""
    have = set(R.variants(e, "val_loss_vs_adamw_median"))
    if not all(f"{p}Gefen-{b}-compact" in have for p in protocols for b in ("8bit", "4bit")):
        return ""
    names = [f"Gefen-{b}-compact" for b in ("8bit", "4bit")]
    loss = [max(R.need(e, "val_loss_vs_adamw_median", p + n, **where) for p in protocols) for n in names]
    state = [_state(R, e, protocols[0] + n) for n in names]
    compact_rows = [r for r in R.rows(e, "val_loss_vs_adamw_median") if "compact" in r["variant"]]
    before = "".join(f" ({n} {what})" for n, what in measured_before_grouped(R.run(e), compact_rows))
    return (f" The compact layout (gefen-x's bytes or fewer): 8-bit {pct(loss[0])}, 4-bit {pct(loss[1])} at "
            f"{state[0]:.3f} / {state[1]:.3f} B/param{before}.")


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
    share = next(v for v in R.variants(e, "val_loss_vs_adamw_median") if v.startswith("dropin/gefen-x@"))
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


def gefen_factored(R):
    e = "convergence"
    prefixes = ["", "char-gpt-1266k/", "char-gpt-429k-docstrings/"]
    out = [_factored(R, e, m, p) for m, p in zip(MODELS, prefixes)]
    loss_ok, bytes_word = _factored_verdict([o[0] for o in out], [o[1] for o in out])
    names = list(MODELS.values())
    many = {n: f" ({_seeds_count(R, m)} seeds)" if convergence.seeds_prefix(m) is not None else ""
            for m, n in zip(MODELS, names)}
    met = [n + many[n] for n, ok in zip(names, loss_ok) if ok]
    missed = [n + many[n] for n, ok in zip(names, loss_ok) if not ok]
    verdict = (f"loss met on {', '.join(met) or 'none'}" + (f"; not on {', '.join(missed)}" if missed else "")
               + f"; {bytes_word}")
    head = (f"worse protocol: 8-bit {' / '.join(pct(o[0][0]) for o in out)}, 4-bit {' / '.join(pct(o[0][1]) for o in out)}; "
            f"8-bit state {' / '.join(f'{o[1][0]:.2f}' for o in out)} B/param ({' / '.join(names)})")
    return Row("Gefen at AdamW's loss with a factored second moment (ours), both protocols", verdict, head,
               fig(e), cmd(f"python experiments/{e}.py"),
               f"{_factored_detail(R, e)} {ablations_text(R, 'gefen_factored')}")


def _untuned(R, e, model, claim, about, row):
    """Claims row ``row`` (a function's name), of a model Gefen was not tuned on; ``about`` says what
    the architecture is, in words."""
    loss, state = _factored(R, e, model)
    loss_ok, bytes_word = _factored_verdict([loss], [state])
    verdict = ("loss met" if loss_ok[0] else "loss not met") + f"; {bytes_word}"
    many = f"; drop-in: {_seeds_count(R, model)} seeds" if convergence.seeds_prefix(model) is not None else ""
    head = (f"8-bit {pct(loss[0])}, 4-bit {pct(loss[1])} vs AdamW (both protocols{many}); {state[0]:.2f} / "
            f"{state[1]:.2f} B/param")
    return Row(claim, verdict, head, fig(e), cmd(f"python experiments/convergence.py --experiment {e}"),
               _untuned_detail(R, e, model, about, state) + _compact(R, e, ("", "dropin/"), x_value=model) + " "
               + ablations_text(R, row))


def _untuned_detail(R, e, model, about, state):
    c = R.config(e)
    best = {r["variant"]: r["value"] for r in select(R.rows(e, "best_lr"), "best_lr")}
    adamw_lr = best["AdamW"]
    gefens = all(v == adamw_lr for k, v in best.items() if k.startswith("Gefen"))
    protocols = "so the two protocols coincide" if all(v == adamw_lr for v in best.values()) else "under both protocols"

    def med(v):
        return R.need(e, "val_loss_vs_adamw_median", v, x_value=model)

    share = next(v for v in R.variants(e, "val_loss_vs_adamw_median") if v.startswith("dropin/gefen-x@"))
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
                    "moment in square tiles of rows, q, k and v a column factor each, one v per element of a vector",
                    "gefen_encoder")


def gefen_llama(R):
    return _untuned(R, "convergence_llama", "char-llama-427k", "… on a Llama-style model",
                    "RMSNorm, SwiGLU, rotary positions, no biases, an untied head; the only tiles in the gate and up "
                    "projections", "gefen_llama")


def gefen_long(R):
    e, short, best = "convergence_long_lr", "convergence_encoder", "convergence_long"
    seeds = {r["seed"] for r in select(R.rows(e, "val_loss_vs_adamw"), "val_loss_vs_adamw")}
    long = [R.need(e, "val_loss_vs_adamw_median", f"dropin/Gefen-{b}-factored") for b in ("8bit", "4bit")]
    before = [median_over_seeds(R.rows(short, "val_loss_vs_adamw"), "val_loss_vs_adamw",
                                f"dropin/Gefen-{b}-factored", seeds) for b in ("8bit", "4bit")]
    if not all(math.isfinite(b) for b in before):
        raise ResultsError(f"{R.dir / short}.csv: no val_loss_vs_adamw of the factored Gefens' seeds {sorted(seeds)}")
    change = [seed_change(R, e, short, f"dropin/Gefen-{b}-factored", seeds) for b in ("8bit", "4bit")]
    grew = [(a - b) * 100 for a, b in zip(long, before)]
    verdict = ("met" if not any(g > 0 for g in grew) else
               f"not met by the median: the factored gaps grow {' / '.join(signed(g) for g in grew)} points; "
               f"paired by seed {' / '.join(f'{signed(m)} ± {se:.2f}' for m, se in change)} (mean ± s.e.)")
    return Row(f"… and after {R.config(e)['steps']:,} steps (the encoder, drop-in, same lr)", verdict,
               f"8-bit {pct(long[0])} ({R.config(short)['steps']:,} steps: {pct(before[0])}), 4-bit {pct(long[1])} "
               f"({pct(before[1])}) vs AdamW",
               fig(e), cmd(f"python experiments/convergence.py --experiment {e}"),
               _long_detail(R, e, short, best, seeds) + _compact(R, e, ("dropin/",)) + " " + ablations_text(R, "gefen_long"))


def _long_detail(R, e, short, best, seeds):
    names = ["dropin/Gefen-8bit-factored", "dropin/Gefen-4bit-factored", "dropin/gefen-x"]
    share = next(v for v in R.variants(e, "val_loss_vs_adamw_median") if v.startswith("dropin/gefen-x@"))

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
                        for w, (m, se) in zip(words, (seed_change(R, e, short, v, seeds) for v in names)))
            + f". Averaged over each run's last {TAIL} evaluations ({R.config(e)['eval_every']} steps apart) "
            "instead of the final one, the medians are " + ", ".join(
                f"{w} {pct(tail_ratio(R, e, v, seeds))} (from {pct(tail_ratio(R, short, v, seeds))})"
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


def _offload_speeds(R, e, rows, ours) -> dict:
    """{offload set: (our speeds over fused AdamW's, over the fastest AdamW's)} at ``THREADS``; {}
    for a run without the offload part."""
    out = {}
    if not any(r["variant"].startswith("offload-") for r in rows):
        return out
    times = R.rows(e, "step_time_median")
    for r in select(rows, "step_time_vs_adamw"):
        prefix, _, name = r["variant"].rpartition("/")
        if not (prefix.startswith("offload-") and name in ours and r["x_value"] == THREADS):
            continue
        peers = [value(times, "step_time_median", f"{prefix}/{n}", x_value=THREADS) for n in ADAMW_PEERS]
        fastest = min(t for t in peers if math.isfinite(t))
        speeds, over = out.setdefault(prefix, ([], []))
        speeds.append(1 / r["value"])
        over.append(fastest / value(times, "step_time_median", r["variant"], x_value=THREADS))
    return out


def gefen_speed(R):
    from experiments.gefen_speed import SMALL_TENSORS  # the small-tensor model's count of tensors

    e = "gefen_speed"
    rows = R.rows(e, "step_time_vs_adamw", "launches_per_step")
    ours = HEADLINE_GEFENS

    def speeds(model, names=ours):
        return [1 / R.need(e, "step_time_vs_adamw", f"{model}/{n}", x_value=THREADS) for n in names]

    large = speeds("transformer") + speeds("mlp")
    small = speeds("small-tensors")
    launches = [r["value"] for r in select(rows, "launches_per_step") if r["variant"] in ours]
    parts = [("met" if min(large) >= TARGET_CPU else "not met") + " on CPU for large tensors",
             ("met" if min(small) >= TARGET_SMALL else "not met") + " for many small tensors"]
    offload = _offload_speeds(R, e, rows, ours)
    if offload:
        parts.append(("met" if min(min(v) for v, _ in offload.values()) >= TARGET_CPU else "not met")
                     + " at offload scale")
    parts.append(("met" if max(launches) <= LAUNCH_TARGET else "not met") + " for the Triton path's launches")
    peers = {p: [s for m in ("transformer", "mlp", "small-tensors") for s in speeds(m, (p,))]
             for p in ("torchao-AdamW8bit", "gefen-x")}
    counted = {m: [r["value"] for r in select(R.rows(e, m), m) if r["variant"] in ours]
               for m in ("device_ops_per_step", "host_syncs_per_step")}
    counts = sorted({r["x_value"] for r in select(rows, "launches_per_step") if r["variant"] in ours})
    detail = (f"{THREADS:g} thread: {span(large)} fused AdamW's speed on the transformer and MLP (8/4-bit; published, "
              f"factored, compact), {span(small)} on {SMALL_TENSORS} small tensors; torchao 8-bit {span(peers['torchao-AdamW8bit'], 3)}, gefen-x "
              f"{span(peers['gefen-x'], 3)}."
              + "".join(f" Offload scale, {p.removeprefix('offload-')} gradients: {span(v)} fused AdamW's speed, "
                        f"{span(f)} the fastest AdamW's (fused or DeepSpeed's CPU-Adam)." for p, (v, f) in offload.items())
              + f" The Triton path issues {max(counted['device_ops_per_step']):g} torch device "
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
    tests = junit_counts(R.dir / "gpu" / "kernel_tests.xml")
    moves = junit_counts(R.dir / "gpu" / "device_moves.xml")
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
    """State bytes per parameter of optimizer ``name`` on convergence model ``label`` (the ablation summary's
    B/param: gefen_memory's bytes by kind weighted by each kind's parameters)."""
    rows = R.rows("gefen_memory", "state_bytes_per_param_of_kind", "params_of_kind")
    x = ablations.bytes_per_param(rows, label, name)
    if not math.isfinite(x):
        raise ResultsError(f"{R.dir}/gefen_memory.csv: no bytes by kind of {label}/{name}; rerun experiments/gefen_memory.py")
    return x


def gefen_layout(R):
    e = BOUND_RUN  # layout="compact" as it is, beside the same layout without the bound, five models
    labels = [v.removesuffix("/gefen-x") for v in R.variants("gefen_memory", "state_bytes_per_param_of_kind")
              if v.endswith("/gefen-x")]
    per = {b: [_total_bytes(R, m, f"Gefen-{b}-compact") for m in labels] for b in ("8bit", "4bit")}
    gx = [_total_bytes(R, m, "gefen-x") for m in labels]
    wide = [k for k, m in enumerate(labels) if R.config("gefen_memory")["widths"][m] >= WIDE]
    fewer = all(a <= x for a, x in zip(per["8bit"], gx))
    under = all(per[b][k] <= COMPACT_TARGET[b] for b in per for k in wide)
    variant = ablations.COMPACT_VARIANT[8]
    models = [s for s in ablation_summary(R, e) if s.variant == f"{variant}_bound"]
    within = sum(s.median - 1 <= LOSS_TARGET['8bit'] for s in models)
    ordered = sorted(models, key=lambda s: labels.index(s.model) if s.model in labels else len(labels))
    verdict = (f"{'bytes met' if fewer and under else 'bytes not met'}; loss within +{LOSS_TARGET['8bit']:.1%} of "
               f"AdamW's on {within} of {len(models)} models")
    detail = (f"State B/param after one step ({', '.join(labels)}): compact 8-bit "
              f"{joined(per['8bit'], lambda x: f'{x:.3f}')}, 4-bit {joined(per['4bit'], lambda x: f'{x:.3f}')}; gefen-x "
              f"{joined(gx, lambda x: f'{x:.3f}')} (targets at width >= {WIDE}: {COMPACT_TARGET['8bit']} / "
              f"{COMPACT_TARGET['4bit']}). The 8-bit compact layout (`{variant}_bound`, "
              f"`layout=\"compact\"`) over AdamW's loss (drop-in, medians): "
              f"{' / '.join(pct(s.median) for s in ordered)} (the models above; "
              f"{'/'.join(sorted({str(s.seeds) for s in models}))} seeds). "
              f"{ablations_text(R, 'gefen_layout')}")
    lo, hi = (f(per["8bit"][k] for k in wide) for f in (min, max))
    return Row("The factored state at Gefen-X's bytes or fewer (compact layout, ours)", verdict,
               f"8-bit {lo:.3f}–{hi:.3f} B/param at width ≥ {WIDE}, ≤ gefen-x's on "
               f"{sum(a <= x for a, x in zip(per['8bit'], gx))} of {len(gx)} models; loss "
               f"{pct_range([s.median for s in models])} on {len(models)} models", fig("gefen_ablation"),
               cmd(f"python experiments/gefen_ablation.py --ablation {e}"), detail)


ROWS = [gefen_memory, gefen_quality, gefen_ablation, gefen_factored, gefen_encoder, gefen_llama, gefen_long,
        gefen_layout, gefen_bf16, gefen_codebook, gefen_speed, gefen_peak_memory, gefen_hessian, gefen_gpu]
