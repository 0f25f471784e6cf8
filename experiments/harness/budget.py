"""What fits a memory budget: where a search starts, and the search in micro-batches or model widths.

    peaks = read_peaks(results_dir)                                 # gefen_peak_memory.csv, {} without one
    start = micro_batch_start(peaks, gpt_name, config, budget_gib)  # from the peaks, or a fixed guess
    start = width_start(peaks, config, budget_gib, depth)
    largest, smallest_failure, trials = search(trial, "micro_batch", start, MICRO_BATCH["full"])
    largest, smallest_failure = largest_micro_batch(fits, start, hi=512, max_trials=8)
    largest, smallest_failure = largest_width(fits, start, max_width=16384, max_trials=8)

``fits(x)`` is one trial at micro-batch or width ``x``: True fits, False killed for memory, None
failed otherwise. ``search`` takes ``trial(x) -> (code, peak bytes, why)`` instead (code 1 fits, 0
killed for memory, -1 failed otherwise: experiments/measured_step.fit_trial) and keeps every trial.
The search is memcg.largest_that_fits: a geometric ladder from the start, then bisection, to 10% in
micro-batch and 6% in width (12% in parameters). Widths are multiples of ``WIDTH_STEP``, as real
models' are: Gefen's blocks divide a tensor's rows, and at a width like 2602 = 2 x 1301 it keeps one
v per element, 5 B of state a parameter. The start only saves trials: it comes from the peaks of
experiments/gefen_peak_memory.py in the same results folder where that CSV is there, else it is a
fixed guess.
"""

from __future__ import annotations

import math
from pathlib import Path

from experiments.harness.memcg import largest_that_fits

WIDTH_STEP = 64
# the GPT's micro-batch search (experiments/gefen_budgets.py, and gefen_distributed.py without its CSV)
MICRO_BATCH = {"full": dict(budgets=[0.5], hi=512, trials=8), "quick": dict(budgets=[0.03125], hi=128, trials=2)}
GUESS = {"micro_batch": 4, "width": 512}  # starts without peaks


def read_peaks(results_dir) -> dict:
    """{(model, micro_batch, config): {"params", "tensor_peak", "rss_total"}} from
    ``<results_dir>/gefen_peak_memory.csv`` (the last two: bytes per parameter, per step); {} without it."""
    from experiments.harness.common import read_results

    path = Path(results_dir) / "gefen_peak_memory.csv"
    if not path.exists():
        return {}
    out = {}
    for r in read_results(path):
        model, mb, config = r["variant"].split("/", 2)
        rec = out.setdefault((model, int(mb[2:]), config), dict(params=0, tensor_peak=[], rss_total=[]))
        if r["metric"] == "params":
            rec["params"] = int(r["value"])
        elif r["metric"] == "tensor_peak_per_param":
            rec["tensor_peak"].append(r["value"])
        elif r["metric"] == "rss_total_per_param":
            rec["rss_total"].append(r["value"])
    return out


def micro_batch_start(peaks, gpt_name, config, budget_gib) -> float:
    """The micro-batch the GPT's tensor peaks at its micro-batches predict fits in ``budget_gib``
    (a line through the first and last, less 15% for what tensors do not count)."""
    pts = sorted((mb, max(r["tensor_peak"]) * r["params"]) for (m, mb, c), r in peaks.items()
                 if m == gpt_name and c == config and r["tensor_peak"])
    if len(pts) >= 2 and pts[-1][1] > pts[0][1]:
        slope = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
        return max(1, 0.85 * (budget_gib * 2**30 - (pts[0][1] - slope * pts[0][0])) / slope)
    return GUESS["micro_batch"]


def width_start(peaks, config, budget_gib, depth, micro_batch=8) -> float:
    """The MLP width the resident set per parameter of the largest peaks MLP (at ``micro_batch``)
    predicts fits in ``budget_gib`` at ``depth`` layers."""
    mlps = [r for (m, mb, c), r in peaks.items() if m.startswith("mlp-") and mb == micro_batch and c == config
            and r["rss_total"]]
    if not mlps:
        return GUESS["width"]
    rec = max(mlps, key=lambda r: r["params"])
    return math.sqrt(budget_gib * 2**30 / max(rec["rss_total"]) / depth)


def largest_micro_batch(fits, start, hi, max_trials):
    """(largest micro-batch that fits or 0, smallest that failed or None), to 10%."""
    return largest_that_fits(fits, start, 1, hi, grow=1.5, max_trials=max_trials)


def largest_width(fits, start, max_width, max_trials):
    """(largest width that fits or 0, smallest that failed or None), multiples of ``WIDTH_STEP``, to 6%
    (about 12% in parameters)."""
    ok, bad = largest_that_fits(lambda k: fits(WIDTH_STEP * k), start / WIDTH_STEP, 1, max_width // WIDTH_STEP,
                                grow=1.25, tol=1.06, max_trials=max_trials)
    return WIDTH_STEP * ok, bad and WIDTH_STEP * bad


def search(trial, what, start, limits):
    """One optimizer's search under one budget in ``what`` ("micro_batch" or "width") with ``limits``
    (``hi`` or ``max_width``, ``trials``): (largest, smallest failure, [(x, code, peak bytes, why)])."""
    trials = []

    def fits(x):
        code, peak, why = trial(x)
        trials.append((x, code, peak, why))
        return None if code < 0 else code == 1

    if what == "micro_batch":
        ok, bad = largest_micro_batch(fits, start, limits["hi"], limits["trials"])
    else:
        ok, bad = largest_width(fits, start, limits["max_width"], limits["trials"])
    return ok, bad, trials
