"""Gefen: optimizer-state bytes per parameter and CPU step time, next to its peers.

    python experiments/gefen_memory.py             # full run -> results/gefen_memory.csv
    python experiments/gefen_memory.py --quick     # torchao left out, fewer repeats -> results/quick/
    python analysis/gefen_memory.py                # paper_figs/gefen_memory.png

Claims judged: on a 3.4 M-parameter ``nn.TransformerEncoder`` model (d=256, 4 layers) and a 2 M
parameter MLP, Gefen keeps <= 1.05 bytes of state per parameter at 8 bits and <= 0.55 at 4 bits, and
its CPU step costs <= 4x fused AdamW's. (Its loss against AdamW is experiments/convergence.py's.)

Memory: tensor bytes of ``optimizer.state_dict()`` after one step (experiments/harness/registry.py's rule),
divided by the parameter count. Time: median over repeats of one ``step()`` on fixed gradients,
every optimizer stepped once per repeat in turn (experiments/harness/train.py's ``interleaved``), all on
``--threads`` torch threads (ours runs its numba kernels on as many); rows carry the time and its
ratio to AdamW's median from the same run. Optimizers (registry names): AdamW (fused), Adam-mini,
torchao-AdamW8bit, torchao-AdamW4bit, gefen-upstream, Gefen-8bit, Gefen-4bit, and both with the
factored second moment (Gefen-8bit-factored, Gefen-4bit-factored), whose step time is also given as a
ratio to the unfactored Gefen's of the same bits, timed in the same interleaved run, and the factored
layout at Gefen-X's bytes or fewer (Gefen-8bit-compact, Gefen-4bit-compact: layout "compact"'s
options).

Rows (variant = optimizer, x = model): ``state_bytes_per_param``, ``first_step_time`` (s: blocks,
codebook, compilation where there is any), ``step_time_median`` (s), ``step_time_vs_adamw`` (ratio),
``step_time_vs_unfactored`` (ratio, factored variants), ``threads``.

Bytes by kind of tensor (matrices, embedding tables, vectors, shared state) on the models of
experiments/convergence.py (``--char-lm``: the 116k and 1.27M GPTs, the 429k prose GPT, the encoder,
the Llama-style model), each
after the first step of its training run of ``--seed``, which fixes the blocks: variant
``<model label>/<optimizer>``, ``state_bytes_per_param_of_kind`` and ``params_of_kind`` against
``kind`` (Adam-mini left out: its state needs the model's dimensions).
"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import math
import sys
import time

import torch

from experiments.harness import check
from experiments.harness.common import Results, add_common_args, add_kind_rows
from experiments.harness.models import MODELS, char_lm_model, model_loss
from experiments.harness.registry import DENSE, make_optimizer, state_bytes, state_bytes_by_kind
from experiments.harness.train import CHAR_LM, WEIGHT_DECAY, char_lm_label, char_lm_problem, interleaved, median, train_lm


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--repeats": 21}
CHECK_NOTE = ("the full run's models and optimizers, 21 timed steps where it has 61: the bytes (the verdict) are exact, the "
              "step times spread wider")


def memory_and_time(res, model_name, names, repeats, seed):
    make_model, make_input, (dim, heads) = MODELS[model_name]
    torch.manual_seed(seed)
    x = make_input()
    x_ = dict(x_name="model", x_value=model_name)
    opts = {}
    for name in names:
        torch.manual_seed(seed)
        model = make_model()
        try:
            opt = make_optimizer(name, model, 1e-3, **({"dim": dim, "n_heads": heads} if name == "Adam-mini" else {}))
            model_loss(model, x).backward()
            t0 = time.perf_counter()
            opt.step()
            first = time.perf_counter() - t0
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            print(f"[{model_name}] {name}: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
            continue
        n = sum(p.numel() for p in model.parameters())
        bpp = state_bytes(opt) / n
        res.add(name, "state_bytes_per_param", "B/param", bpp, **x_)
        res.add(name, "first_step_time", "s", first, **x_)
        opts[name] = opt
        print(f"[{model_name}] {name}: {n} params, {bpp:.4f} B/param, first step {first:.2f} s", flush=True)
    med = median(interleaved({n: o.step for n, o in opts.items()}, repeats, progress=True,
                             desc=f"{model_name} step times"))
    base = med.get("AdamW", math.nan)
    for name, t in med.items():
        res.add(name, "step_time_median", "s", t, **x_)
        res.add(name, "step_time_vs_adamw", "ratio", t / base, **x_)
        res.add(name, "threads", "count", torch.get_num_threads(), **x_)
        print(f"[{model_name}] {name}: median step {t * 1e3:.1f} ms = {t / base:.2f}x AdamW")
        plain = name.removesuffix("-factored")
        if plain != name and plain in med:
            res.add(name, "step_time_vs_unfactored", "ratio", t / med[plain], **x_)
            print(f"[{model_name}] {name}: {t / med[plain]:.3f}x {plain}")


# experiments/convergence.py's models, whose state bytes by kind of tensor follow their first step
CHAR_LMS = ["full", "large", "docstrings", "encoder", "llama"]


def bytes_by_kind(res, size_name, names, seed):
    """Each optimizer's state bytes per parameter by kind of tensor (registry.state_bytes_by_kind)
    on a ``CHAR_LM`` model after its first training step of ``seed``: the initialisation, batch and
    clipping of experiments/convergence.py's run of that seed, whose blocks and so bytes it fixes.
    Rows: variant ``<model label>/<optimizer>``, ``state_bytes_per_param_of_kind`` and
    ``params_of_kind`` against ``kind``."""
    size = CHAR_LM[size_name]
    cfg, (train_ids, val), n = char_lm_problem(size)
    label = char_lm_label(size)
    for name in names:
        torch.manual_seed(seed)
        model = char_lm_model(cfg)
        try:
            opt = make_optimizer(name, model, 1e-3, WEIGHT_DECAY)
            train_lm(model, opt, train_ids, val, lr=1e-3, steps=1, batch=size["batch"], seed=seed, eval_every=1)
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            print(f"[{label}] {name}: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
            continue
        per = add_kind_rows(res, f"{label}/{name}", state_bytes_by_kind(opt, model), n)
        print(f"[{label}] {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in per.items()) + " B/param", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every optimizer (ours: as many numba threads)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per optimizer (default 61, quick 7)")
    parser.add_argument("--optimizers", nargs="+", default=None, choices=DENSE,
                        help="default: all; with --quick all but torchao's (they compile on first use)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--char-lm", nargs="*", default=None, choices=list(CHAR_LM),
                        help=f"convergence models for the bytes by kind of tensor (default: {' '.join(CHAR_LMS)}; "
                             "quick: tiny; none: --char-lm with no size)")
    args = check.parse(parser, argv)
    torch.set_num_threads(args.threads)
    if args.optimizers is None:
        args.optimizers = [n for n in DENSE if not (args.quick and n.startswith("torchao"))]
    if args.char_lm is None:
        args.char_lm = ["tiny"] if args.quick else CHAR_LMS
    repeats = args.repeats or (7 if args.quick else 61)  # millisecond steps: many, to resolve a 15% ratio
    widths = {char_lm_label(CHAR_LM[s]): CHAR_LM[s]["n_embd"] for s in args.char_lm}  # model label -> width
    config = dict(vars(args), repeats=repeats, threads=torch.get_num_threads(), widths=widths)
    with Results("gefen_memory", args, config=config) as res:
        for model_name in args.models:
            memory_and_time(res, model_name, args.optimizers, repeats, args.seed)
            res.flush()
        for size_name in args.char_lm:
            bytes_by_kind(res, size_name, [n for n in args.optimizers if n != "Adam-mini"], args.seed)
            res.flush()


if __name__ == "__main__":
    main()
