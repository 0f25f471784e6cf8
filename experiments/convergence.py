"""Convergence: a character-level GPT trained by every memory-light optimizer and its peers.

Does Gefen reach AdamW's validation loss with about one byte of optimizer state per parameter?
A small nanoGPT-style character model (experiments/_charlm.py) learns Python's documentation
topics plus standard-library sources (no download; fixed file list, capped characters; 90/10
train/validation split by chunks). Peers: torch AdamW, Adam-mini (``adam-mini``), torchao
AdamW8bit and AdamW4bit, upstream ``gefen``, and ours (optim.Gefen at 8 and 4 bits).

Protocol: every optimizer gets the same model initialisation and the same batches per seed, the
same schedule (linear warm-up over 5% of the steps, cosine decay to 10%), gradient clipping at
1.0 and decoupled weight decay 0.1 on every tensor (Adam-mini exempts norms and biases by its own
name rule). Each optimizer's learning rate is chosen from a small grid by the final validation
loss of the first seed; the chosen rate is then rerun with two more seeds. State bytes are the
tensor bytes of ``optimizer.state_dict()`` after training (tensor subclasses counted by their
inner tensors; non-tensor entries not counted). An optimizer that fails to construct or to step
is skipped with its reason printed, and writes no rows.

    # full CPU run (about 25 minutes on 2 cores); writes results/convergence.csv
    python experiments/convergence.py
    python analysis/convergence.py            # paper_figs/convergence.png

    # tens of seconds: tiny model, few steps, one seed, one learning rate
    python experiments/convergence.py --quick

    # a subset, or other grids
    python experiments/convergence.py --optimizers AdamW Gefen-8bit --lrs 1e-3 3e-3 --seeds 1

Rows (variant = "<optimizer>/lr=<lr>", seed = the run's seed): ``val_loss`` and ``train_loss``
(nats/char) against ``step``; ``final_val_loss`` against ``state_bytes``; ``state_bytes``,
``state_bytes_per_param``, ``params``, ``step_time`` (median optimizer.step(), ms), ``wall_time``.
Per optimizer (variant = "<optimizer>"): ``best_lr``, the chosen learning rate.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from experiments import _charlm as charlm  # noqa: E402
from experiments.common import Results, add_common_args  # noqa: E402

EXPERIMENT = "convergence"

# Model and schedule per size. "full" is sized so that 7 optimizers x (3 learning rates + 2 extra
# seeds) fit in about 25 minutes on 2 CPU cores shared with other jobs (measured on such a machine:
# ~85 ms per forward+backward, torchao ~100 s of torch.compile per variant, upstream gefen ~40 s
# of first-step set-up per run); "tiny" is for the tests (seconds).
SIZES = {
    "tiny": dict(n_layer=1, n_head=2, n_embd=16, block=16, batch=8, steps=6, eval_every=3,
                 eval_windows=16, max_chars=60_000, lrs=[3e-3], seeds=1),
    "quick": dict(n_layer=2, n_head=2, n_embd=32, block=32, batch=16, steps=60, eval_every=20,
                  eval_windows=64, max_chars=200_000, lrs=[3e-3], seeds=1),
    "full": dict(n_layer=2, n_head=4, n_embd=64, block=64, batch=16, steps=200, eval_every=20,
                 eval_windows=128, max_chars=1_000_000, lrs=[1e-3, 3e-3, 1e-2], seeds=3),
}
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0


# ---------------------------------------------------------------- optimizer registry
REGISTRY = {}


def register(name):
    def deco(fn):
        REGISTRY[name] = fn
        return fn
    return deco


@register("AdamW")
def _adamw(model, lr, wd, cfg):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)


@register("Adam-mini")
def _adam_mini(model, lr, wd, cfg):
    from adam_mini import Adam_mini

    opt = Adam_mini(model.named_parameters(), lr=lr, weight_decay=wd, dim=cfg.n_embd,
                    n_heads=cfg.n_head, verbose=False)
    opt.embd_names.add("wpe")  # position embedding: one second moment per position, like wte
    return opt


@register("torchao-AdamW8bit")
def _ao8(model, lr, wd, cfg):
    from torchao.optim import AdamW8bit

    return AdamW8bit(model.parameters(), lr=lr, weight_decay=wd)


@register("torchao-AdamW4bit")
def _ao4(model, lr, wd, cfg):
    from torchao.optim import AdamW4bit

    return AdamW4bit(model.parameters(), lr=lr, weight_decay=wd)


@register("gefen-upstream")
def _gefen_upstream(model, lr, wd, cfg):
    from gefen import Gefen as UpstreamGefen

    return UpstreamGefen(model.named_parameters(), lr=lr, weight_decay=wd)


@register("Gefen-8bit")
def _gefen8(model, lr, wd, cfg):
    from optim import Gefen

    return Gefen(model.parameters(), lr=lr, weight_decay=wd, bits=8)


@register("Gefen-4bit")
def _gefen4(model, lr, wd, cfg):
    from optim import Gefen

    return Gefen(model.parameters(), lr=lr, weight_decay=wd, bits=4)


# ---------------------------------------------------------------- measurement helpers
def tensor_bytes(obj, _seen=None) -> int:
    """Bytes of every tensor inside ``obj`` (nested dicts/lists/tuples), each storage view once.

    Tensor subclasses (torchao's quantised states) count by their inner tensors (codes, scales,
    code maps), not by the dense shape they pretend to have. Non-tensor entries count nothing.
    """
    seen = set() if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n), seen) for n in names)
        nbytes = obj.numel() * obj.element_size()
        key = (obj.data_ptr(), nbytes, obj.dtype)
        if nbytes and key in seen:
            return 0
        seen.add(key)
        return nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def state_bytes(opt) -> int:
    return tensor_bytes(opt.state_dict())


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warm = max(1, steps // 20)
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def set_lr(opt, base: float):
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):  # torchao keeps lr as a tensor
            g["lr"].fill_(base)
        else:
            g["lr"] = base


def build(name, model, lr, cfg):
    # upstream gefen prints on construction and at its first steps; keep the log readable
    with contextlib.redirect_stdout(io.StringIO()):
        return REGISTRY[name](model, lr, WEIGHT_DECAY, cfg)


def train_one(name, lr, seed, size, data, cfg, progress=True):
    """One training run. Returns a dict of curves and summary numbers (final_val_loss NaN if diverged)."""
    train, (vx, vy) = data
    torch.manual_seed(seed)
    model = charlm.GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    opt = build(name, model, lr, cfg)
    gen = torch.Generator().manual_seed(seed)
    steps, every = size["steps"], size["eval_every"]
    val_curve = [(0, charlm.evaluate(model, vx, vy))]
    train_curve, window, step_times = [], [], []
    diverged = False
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=f"{name} lr={lr:g} seed={seed}", leave=False, disable=not progress,
               mininterval=2.0)
    for step in bar:
        set_lr(opt, lr * lr_factor(step, steps))
        x, y = charlm.get_batch(train, size["batch"], cfg.block, gen)
        loss = model(x, y)
        if not torch.isfinite(loss):
            diverged = True
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        t0 = time.perf_counter()
        if step < 2:
            with contextlib.redirect_stdout(io.StringIO()):
                opt.step()
        else:
            opt.step()
        step_times.append(time.perf_counter() - t0)
        window.append(loss.item())
        if (step + 1) % every == 0 or step + 1 == steps:
            train_curve.append((step + 1, statistics.fmean(window)))
            window = []
            val_curve.append((step + 1, charlm.evaluate(model, vx, vy)))
            bar.set_postfix(val=f"{val_curve[-1][1]:.3f}")
            if not math.isfinite(val_curve[-1][1]):
                diverged = True
                break
    final = float("nan") if diverged else val_curve[-1][1]
    return dict(val=val_curve, train=train_curve, final=final, params=n_params,
                state_bytes=state_bytes(opt), step_time=statistics.median(step_times) if step_times else float("nan"),
                wall=time.perf_counter() - start)


def add_run_rows(res, name, lr, seed, out):
    v = f"{name}/lr={lr:g}"
    for step, val in out["val"]:
        res.add(v, "val_loss", "nats/char", val, x_name="step", x_value=step, seed=seed)
    for step, val in out["train"]:
        res.add(v, "train_loss", "nats/char", val, x_name="step", x_value=step, seed=seed)
    res.add(v, "final_val_loss", "nats/char", out["final"], x_name="state_bytes", x_value=out["state_bytes"], seed=seed)
    res.add(v, "state_bytes", "bytes", out["state_bytes"], seed=seed)
    res.add(v, "state_bytes_per_param", "B/param", out["state_bytes"] / out["params"], seed=seed)
    res.add(v, "params", "count", out["params"], seed=seed)
    res.add(v, "step_time", "ms", 1e3 * out["step_time"], seed=seed)
    res.add(v, "wall_time", "s", out["wall"], seed=seed)


class _Skip(Exception):
    pass


def run_optimizer(name, size, lrs, seeds, base_seed, data, cfg, progress):
    """LR sweep on the first seed, then the best LR on the other seeds. Returns (rows, best_lr, finals)."""
    runs = []

    def attempt(lr, seed):
        try:
            out = train_one(name, lr, seed, size, data, cfg, progress)
        except Exception as exc:  # a peer that cannot run here is skipped, not fatal
            raise _Skip(f"{type(exc).__name__}: {exc}") from exc
        runs.append((lr, seed, out))
        return out

    sweep = {lr: attempt(lr, base_seed)["final"] for lr in lrs}
    best = min(lrs, key=lambda lr: sweep[lr] if math.isfinite(sweep[lr]) else float("inf"))
    for s in range(1, seeds):
        attempt(best, base_seed + s)
    return runs, best


def check_constructs(name, cfg):
    """Build the optimizer on a fresh model; return None or the reason it cannot be used."""
    try:
        build(name, charlm.GPT(cfg), 1e-3, cfg)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--tiny", action="store_true", help="test size: a 1-layer model for a few steps (seconds)")
    parser.add_argument("--optimizers", nargs="+", default=list(REGISTRY), metavar="NAME",
                        help=f"subset of {', '.join(REGISTRY)} (default: all)")
    parser.add_argument("--lrs", nargs="+", type=float, default=None, help="learning-rate grid (default per size)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds at the best lr (default per size)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default per size)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    # One intra-op thread: on the shared 2-core machine a forward+backward of the full model took
    # 110 ms with 1 thread and 1020 ms with 2 (oversubscribed by other jobs); at 116 k parameters
    # a second thread has little work to share anyway.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.optimizers if n not in REGISTRY]
    if unknown:
        parser.error(f"--optimizers: unknown {unknown}; choose from {list(REGISTRY)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    size_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    size = dict(SIZES[size_name])
    if args.steps is not None:
        size["steps"] = args.steps
    lrs = args.lrs or size["lrs"]
    seeds = args.seeds or size["seeds"]
    cfg = charlm.GPTConfig(block=size["block"], n_layer=size["n_layer"], n_head=size["n_head"],
                           n_embd=size["n_embd"])
    train, val = charlm.load_splits(size["max_chars"])
    vx, vy = charlm.eval_windows(val, size["eval_windows"], cfg.block)
    data = (train, (vx, vy))

    usable, skipped = [], {}
    for name in args.optimizers:
        reason = check_constructs(name, cfg)
        if reason:
            skipped[name] = reason
            print(f"[convergence] skipping {name}: it fails to construct ({reason})", flush=True)
        else:
            usable.append(name)

    config = dict(vars(args), size=size_name, **dict(size, lrs=lrs, seeds=seeds), model=vars(cfg),
                  weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP, schedule="5% linear warm-up, cosine to 10%",
                  lr_selection="best final val loss of the first seed; best lr rerun on the other seeds",
                  train_tokens=train.numel(), val_tokens=val.numel(), python=sys.version.split()[0],
                  stdlib_files=len(charlm.stdlib_sources()), optimizers_run=usable, optimizers_skipped=skipped,
                  threads=torch.get_num_threads())
    print(f"[convergence] size={size_name} model={vars(cfg)} steps={size['steps']} batch={size['batch']} "
          f"lrs={lrs} seeds={seeds} train/val tokens={train.numel()}/{val.numel()} threads={torch.get_num_threads()}",
          flush=True)
    summary = []
    with Results(EXPERIMENT, args, config=config) as res:
        for name in tqdm(usable, desc="optimizers", disable=args.no_progress):
            try:
                runs, best = run_optimizer(name, size, lrs, seeds, args.seed, data, cfg, not args.no_progress)
            except _Skip as exc:
                skipped[name] = str(exc)
                print(f"[convergence] skipping {name}: it fails to run ({exc})", flush=True)
                continue
            for lr, seed, out in runs:
                add_run_rows(res, name, lr, seed, out)
            res.add(name, "best_lr", "lr", best, x_name="selected_by", x_value=f"final_val_loss seed {args.seed}")
            res.flush()  # keep what is measured if a later optimizer takes the process down
            chosen = [out for lr, _, out in runs if lr == best]
            bpp = statistics.fmean(o["state_bytes"] / o["params"] for o in chosen)  # blocks vary with the seed
            summary.append((name, best, [o["final"] for o in chosen], bpp,
                            statistics.median(o["step_time"] for *_, o in runs)))
    print(f"\n{'optimizer':<20} {'best lr':>8} {'final val loss':>18} {'B/param':>8} {'step ms':>8}")
    for name, best, finals, bpp, st in summary:
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        print(f"{name:<20} {best:>8g} {statistics.fmean(finals):>10.4f} ± {sd:.4f} {bpp:>8.3f} {1e3 * st:>8.2f}")
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    return summary, skipped


if __name__ == "__main__":
    main()
