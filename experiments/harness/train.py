"""The training loop and the step timer every experiment uses.

``train_lm``: one run of a character language model under one protocol: the same initialisation
and batches per seed for every optimizer, linear warm-up over 5% of the steps then cosine decay to
10% of the peak learning rate, gradient clipping at 1.0, validation loss on fixed windows at a fixed
interval. Weight decay is the optimizer's (``registry.make_optimizer(..., weight_decay=...)``).

``interleaved``: medians of step times that other jobs on the machine cannot bias one-sidedly:
every repeat runs each candidate once, in turn (optionally in a shuffled order), and records wall
and process-CPU seconds of each call.
"""

from __future__ import annotations

import contextlib
import io
import math
import random
import statistics
import time

import torch
from tqdm import tqdm

from experiments.harness import data
from experiments.harness.models import ARCHITECTURES, char_lm_model, evaluate

GRAD_CLIP = 1.0
WEIGHT_DECAY = 0.1
# The character models' sizes and schedule (experiments/harness/models.py), shared by the experiments that
# train them so that their numbers compare: "tiny" for tests, "quick" for --quick, "full" for the run
# whose results are committed. arch: models.ARCHITECTURES's name (default "gpt"); lrs: the peak
# learning-rate grid; seeds: runs at the chosen rate; corpus: data.load_text's (default "docs+code").
CHAR_LM = {
    "tiny": dict(n_layer=1, n_head=2, n_embd=16, block=16, batch=8, steps=6, eval_every=3,
                 eval_windows=16, max_chars=60_000, lrs=[3e-3], seeds=1),
    "quick": dict(n_layer=2, n_head=2, n_embd=32, block=32, batch=16, steps=60, eval_every=20,
                  eval_windows=64, max_chars=200_000, lrs=[3e-3], seeds=1),
    "full": dict(n_layer=2, n_head=4, n_embd=64, block=64, batch=16, steps=600, eval_every=30,
                 eval_windows=128, max_chars=1_000_000, lrs=[1e-3, 3e-3, 1e-2], seeds=3),
    # ~11x full's parameters, 1,000 steps; a small batch keeps a single-threaded run near a minute (and
    # wants a lower lr: the grid straddles AdamW's best)
    "large": dict(n_layer=2, n_head=4, n_embd=224, block=64, batch=4, steps=1000, eval_every=100,
                  eval_windows=64, max_chars=1_000_000, lrs=[5e-4, 1e-3, 2e-3], seeds=3),
    # another corpus (English prose only) and another shape: wider than "full", narrower than "large";
    # six seeds: every optimizer leaves a loss plateau between steps 500 and 700 at a seed-dependent
    # step, which moves the final loss by a few percent from seed to seed
    "docstrings": dict(n_layer=2, n_head=4, n_embd=128, block=64, batch=8, steps=1000, eval_every=100,
                       eval_windows=64, max_chars=1_000_000, lrs=[1e-3, 3e-3, 1e-2], seeds=6,
                       corpus="docstrings"),
    # two architectures the optimizers were not developed on (models.EncoderLM, a stack of torch's
    # nn.TransformerEncoderLayer with its fused q/k/v tensor, and models.LlamaLM), on "full"'s corpus
    # with a larger batch; a wide grid of factors of two, since another architecture has its own best lr
    "encoder": dict(arch="encoder", n_layer=2, n_head=4, n_embd=128, block=64, batch=32, steps=1000,
                    eval_every=100, eval_windows=128, max_chars=1_000_000, lrs=[1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2],
                    seeds=5),
    "llama": dict(arch="llama", n_layer=2, n_head=4, n_embd=128, block=64, batch=32, steps=1000,
                  eval_every=100, eval_windows=128, max_chars=1_000_000, lrs=[1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2],
                  seeds=5),
}


_PROBLEMS = {}


def char_lm_problem(size: dict):
    """(model config, (training ids, fixed validation windows (x, y)), n_params) of one ``CHAR_LM``
    size, built once per process (the tensors are shared: read them, do not write them); the config
    is of the size's architecture (``models.char_lm_model`` builds its model)."""
    key = repr(sorted(size.items()))
    if key not in _PROBLEMS:
        config_cls, _ = ARCHITECTURES[size.get("arch", "gpt")]
        cfg = config_cls(block=size["block"], n_layer=size["n_layer"], n_head=size["n_head"], n_embd=size["n_embd"])
        train, val = data.load_splits(size["max_chars"], corpus=size.get("corpus", data.DEFAULT_CORPUS))
        n_params = sum(p.numel() for p in char_lm_model(cfg).parameters())
        _PROBLEMS[key] = cfg, (train, data.eval_windows(val, size["eval_windows"], cfg.block)), n_params
    return _PROBLEMS[key]


def model_label_of(n_params: int, corpus: str = data.DEFAULT_CORPUS, arch: str = "gpt") -> str:
    """``char-<arch>-<thousands of params>k``, with ``-<corpus>`` for a corpus other than the default."""
    return f"char-{arch}-{n_params // 1000}k" + ("" if corpus == data.DEFAULT_CORPUS else f"-{corpus}")


def char_lm_label(size: dict) -> str:
    """``model_label_of`` one ``CHAR_LM`` size."""
    return model_label_of(char_lm_problem(size)[2], size.get("corpus", data.DEFAULT_CORPUS), size.get("arch", "gpt"))


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warm = max(1, steps // 20)
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def set_lr(opt, lr: float):
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):  # torchao keeps lr as a tensor
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


def interval_metrics(step, train_loss, val_loss, lr, step_times, seconds, tokens) -> dict:
    """The numbers a training run logs at one evaluation: losses, the lr of the last step, the median
    ``opt.step()`` time and the wall time per step over the interval (ms, evaluation excluded), and
    tokens per second over it."""
    n = max(1, len(step_times))
    return {"train/step": step, "train/loss": train_loss, "val/loss": val_loss, "train/lr": lr,
            "train/step_time_ms": 1e3 * statistics.median(step_times) if step_times else float("nan"),
            "train/iter_time_ms": 1e3 * seconds / n, "train/tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


def train_lm(model, opt, train_ids, val_xy, *, lr, steps, batch, seed, eval_every, progress=False, desc="",
             on_eval=None):
    """Train ``model`` (``model(x, y)`` returns the loss) with ``opt``; returns curves and timings.

    Batches come from a generator seeded with ``seed``, so every optimizer of one seed sees the same
    ones. Returns ``val`` and ``train`` as [(step, loss)], ``final`` (NaN if the loss diverged),
    ``step_time`` (median seconds of ``opt.step()``), ``step_times`` (every step's seconds) and
    ``wall`` (seconds of the whole run). ``on_eval(metrics)``, if given, gets ``interval_metrics``
    at every evaluation (experiments/harness/tracking.py logs them live); it runs outside every timed region.
    """
    vx, vy = val_xy
    block = vx.shape[1]
    gen = torch.Generator().manual_seed(seed)
    val_curve = [(0, evaluate(model, vx, vy))]
    train_curve, window, step_times = [], [], []
    diverged = False
    start = window_start = time.perf_counter()
    for step in tqdm(range(steps), desc=desc, leave=False, disable=not progress, mininterval=2.0):
        set_lr(opt, lr * lr_factor(step, steps))
        x, y = data.get_batch(train_ids, batch, block, gen)
        loss = model(x, y)
        if not torch.isfinite(loss):
            diverged = True
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) if step < 2 else contextlib.nullcontext():
            opt.step()  # upstream gefen prints at its first steps
        step_times.append(time.perf_counter() - t0)
        window.append(loss.item())
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            seconds = time.perf_counter() - window_start
            train_curve.append((step + 1, statistics.fmean(window)))
            val_curve.append((step + 1, evaluate(model, vx, vy)))
            if on_eval is not None:
                on_eval(interval_metrics(step + 1, train_curve[-1][1], val_curve[-1][1], lr * lr_factor(step, steps),
                                         step_times[-len(window):], seconds, len(window) * batch * block))
            window = []
            if not math.isfinite(val_curve[-1][1]):
                diverged = True
                break
            window_start = time.perf_counter()
    return dict(val=val_curve, train=train_curve, final=float("nan") if diverged else val_curve[-1][1],
                step_time=statistics.median(step_times) if step_times else float("nan"),
                step_times=step_times, wall=time.perf_counter() - start)


def interleaved(fns: dict, repeats: int, *, shuffle: bool = False, before=None, progress=False, desc=""):
    """Time each of ``fns`` (name -> zero-argument callable) once per repeat, in turn.

    ``shuffle``: a different (seeded) order every repeat, so no candidate always follows the same
    one. ``before(name)``, if given, runs untimed before each call. Returns
    ``{name: {"wall": [seconds], "cpu": [seconds]}}``.
    """
    out = {name: {"wall": [], "cpu": []} for name in fns}
    for rep in tqdm(range(repeats), desc=desc, leave=False, disable=not progress):
        order = list(fns)
        if shuffle:
            random.Random(rep).shuffle(order)
        for name in order:
            if before is not None:
                before(name)
            w0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            out[name]["wall"].append(time.perf_counter() - w0)
            out[name]["cpu"].append(time.process_time() - c0)
    return out


def median(times: dict, key: str = "wall") -> dict:
    """{name: median seconds} of an ``interleaved`` result."""
    return {name: statistics.median(t[key]) for name, t in times.items()}
