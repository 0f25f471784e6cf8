"""Gefen: optimizer-state bytes per parameter, CPU step time, and loss against AdamW.

Claims (issue 4): on a 3.4 M-parameter ``nn.TransformerEncoder`` model (d=256, 4 layers) Gefen keeps
<= 1.05 bytes of state per parameter at 8 bits and <= 0.55 at 4 bits, its CPU step costs <= 4x
``torch.optim.AdamW(fused=True)``'s, and 200 steps of a character model of Python's documentation
text (``pydoc_data.topics``) end within 3% of AdamW's loss.

Commands::

    python experiments/gefen_memory.py --quick     # torchao left out, 7 repeats, loss: 1 seed, lr 3e-3
    python experiments/gefen_memory.py --threads 2 # all optimizers (torchao compiles ~3 min each),
                                                   # 21 timing repeats, loss: lr grid, 3 seeds
    # or in two runs (analysis/gefen_memory.py keeps the newest rows per variant and metric):
    python experiments/gefen_memory.py --threads 2 --skip-loss
    python experiments/gefen_memory.py --skip-timing

Memory: tensor bytes of ``optimizer.state_dict()`` after one step (tensor subclasses such as
torchao's quantised states counted by their inner tensors), divided by the parameter count.
Time: median over repeats of one ``step()`` on fixed gradients, every optimizer stepped once per
repeat in turn (interleaved), ``torch.set_num_threads(--threads)`` for all of them; rows carry
the time and its ratio to fused AdamW's median from the same run.
Ours runs its numba kernel on as many threads as torch (``--threads``); rows ``threads`` say how many.
Optimizers: AdamW (fused), Adam-mini (``adam-mini``), torchao AdamW8bit / AdamW4bit, upstream
``gefen`` (its CPU path), ours at 8 and 4 bits.
Loss: fused AdamW, upstream ``gefen``, ours at 8 and 4 bits train a character ``Encoder`` (d=128,
2 layers, context 64, batch 32; 90/10 split of ``pydoc_data.topics``) for 200 steps with
experiments/convergence.py's protocol: linear warm-up over 5% of the steps, cosine decay to 10%,
gradient clipping at 1.0, weight decay 0.1; each optimizer's peak learning rate is the best of the
same grid (``--lrs``) on the first seed, then two more seeds; the same initialisation and batches
per seed for every optimizer. Rows: ``val_loss`` per seed, ``val_loss_vs_adamw`` per seed (ratio to
AdamW's of the same seed), its ``_mean`` and ``_std`` over seeds, ``best_lr``, ``val_loss_lr_sweep``.
"""

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from experiments.common import Results, add_common_args  # noqa: E402
from experiments.convergence import tensor_bytes  # noqa: E402  (one state-bytes rule for all experiments)
from optim import Gefen  # noqa: E402


# ------------------------------------------------------------------------------------- models
class Encoder(torch.nn.Module):
    """Token embedding + ``nn.TransformerEncoder`` (tied output): 3.42 M parameters at the defaults."""

    def __init__(self, vocab=1000, d=256, layers=4, heads=8, ff=1024, ctx=64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        # fixed sinusoidal positions: the model is the embedding and the encoder, 3,415,040 params
        pos = torch.arange(ctx, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
        self.register_buffer("pos", torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1))
        layer = torch.nn.TransformerEncoderLayer(d, heads, ff, batch_first=True, dropout=0.0)
        self.enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(ctx))

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        h = self.enc(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return h @ self.emb.weight.t()


def make_mlp():
    return torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                               torch.nn.GELU(), torch.nn.Linear(1024, 10))


MODELS = {
    "transformer": (lambda: Encoder(), lambda: torch.randint(0, 1000, (8, 64))),
    "mlp": (make_mlp, lambda: torch.randn(64, 784)),
}


def model_loss(model, x):
    out = model(x)
    if isinstance(model, Encoder):
        return torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))
    return out.pow(2).mean()


# --------------------------------------------------------------------------------- optimizers
def _adam_mini(model, lr, wd=0.0):
    import adam_mini

    return adam_mini.Adam_mini(model.named_parameters(), lr=lr, weight_decay=wd, dim=256, n_heads=8, verbose=False)


def _torchao(name):
    def make(model, lr, wd=0.0):
        import torchao.optim

        return getattr(torchao.optim, name)(model.parameters(), lr=lr, weight_decay=wd)
    return make


def _upstream(model, lr, wd=0.0):
    import gefen

    return gefen.Gefen(list(model.parameters()), lr=lr, weight_decay=wd, fused=False)


OPTIMIZERS = {
    "AdamW(fused)": lambda m, lr, wd=0.0: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, fused=True),
    "Adam-mini": _adam_mini,
    "torchao AdamW8bit": _torchao("AdamW8bit"),
    "torchao AdamW4bit": _torchao("AdamW4bit"),
    "gefen (upstream)": _upstream,
    "Gefen 8-bit (ours)": lambda m, lr, wd=0.0: Gefen(m.parameters(), lr=lr, weight_decay=wd, bits=8),
    "Gefen 4-bit (ours)": lambda m, lr, wd=0.0: Gefen(m.parameters(), lr=lr, weight_decay=wd, bits=4),
}


# ------------------------------------------------------------------------------- measurements
def memory_and_time(res, model_name, names, repeats, seed):
    make_model, make_input = MODELS[model_name]
    torch.manual_seed(seed)
    x = make_input()
    runs = {}
    for name in names:
        torch.manual_seed(seed)
        model = make_model()
        try:
            opt = OPTIMIZERS[name](model, 1e-3)
            model_loss(model, x).backward()
            t0 = time.perf_counter()
            opt.step()  # first step: blocks, codebook, compilation where there is any
            first = time.perf_counter() - t0
        except Exception as exc:  # a baseline that cannot run here is reported, not fatal
            print(f"[{model_name}] {name}: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
            continue
        n = sum(p.numel() for p in model.parameters())
        bpp = tensor_bytes(opt.state_dict()) / n
        res.add(name, "state_bytes_per_param", "B/param", bpp, x_name="model", x_value=model_name)
        res.add(name, "first_step_time", "s", first, x_name="model", x_value=model_name)
        runs[name] = (opt, [])
        print(f"[{model_name}] {name}: {n} params, {bpp:.4f} B/param, first step {first:.2f} s")
    for _ in tqdm(range(repeats), desc=f"{model_name} step times"):
        for name, (opt, times) in runs.items():  # interleaved: one step of each per repeat
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    base = statistics.median(runs["AdamW(fused)"][1]) if "AdamW(fused)" in runs else float("nan")
    for name, (_, times) in runs.items():
        med = statistics.median(times)
        res.add(name, "step_time_median", "s", med, x_name="model", x_value=model_name)
        res.add(name, "step_time_vs_adamw_fused", "ratio", med / base, x_name="model", x_value=model_name)
        res.add(name, "threads", "count", torch.get_num_threads(), x_name="model", x_value=model_name)
        print(f"[{model_name}] {name}: median step {med * 1e3:.1f} ms = {med / base:.2f}x fused AdamW")


def char_data():
    import pydoc_data.topics

    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    return data, len(chars)


LOSS_OPTIMIZERS = ["AdamW(fused)", "gefen (upstream)", "Gefen 8-bit (ours)", "Gefen 4-bit (ours)"]


def char_run(name, data, vocab, xv, steps, lr, seed, ctx=64, batch=32, make=None):
    """One training run (convergence.py's protocol); returns the final validation loss.

    ``make(model, lr, wd)`` builds the optimizer (default: ``OPTIMIZERS[name]``)."""
    import contextlib
    import io

    from experiments.convergence import GRAD_CLIP, WEIGHT_DECAY, lr_factor, set_lr

    torch.manual_seed(seed)
    model = Encoder(vocab=vocab, d=128, layers=2, heads=4, ff=512, ctx=ctx)
    with contextlib.redirect_stdout(io.StringIO()):  # upstream gefen prints while it sets up
        opt = (make or OPTIMIZERS[name])(model, lr, WEIGHT_DECAY)
    gen = torch.Generator().manual_seed(seed)
    for step in tqdm(range(steps), desc=f"char {name} seed {seed}", leave=False, mininterval=2.0):
        set_lr(opt, lr * lr_factor(step, steps))
        idx = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=gen)
        xb = torch.stack([data[i:i + ctx + 1] for i in idx])
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(xb[:, :-1]).reshape(-1, vocab), xb[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        with contextlib.redirect_stdout(io.StringIO()):
            opt.step()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(xv[:, :-1]).reshape(-1, vocab), xv[:, 1:].reshape(-1)).item()


def char_split(base_seed, ctx=64):
    """(training characters, vocabulary size, 256 validation windows of ctx + 1): a 90/10 split."""
    data, vocab = char_data()
    split = int(0.9 * data.numel())
    train, val = data[:split], data[split:]
    gen = torch.Generator().manual_seed(base_seed + 1)
    val_idx = torch.randint(0, val.numel() - ctx - 1, (256,), generator=gen)
    return train, vocab, torch.stack([val[i:i + ctx + 1] for i in val_idx])


def char_loss(res, names, steps, seeds, lrs, base_seed):
    """Every optimizer, same protocol, same initialisation and batches per seed; ratios per seed.

    As experiments/convergence.py: each optimizer's peak learning rate is the best of ``lrs`` by
    the final validation loss of the first seed (the same grid for every optimizer), then rerun
    with the other seeds.
    """
    ctx = 64
    train, vocab, xv = char_split(base_seed, ctx)
    seed_list = list(range(base_seed, base_seed + seeds))
    finals = {}
    for name in names:
        sweep = {lr: char_run(name, train, vocab, xv, steps, lr, base_seed, ctx=ctx) for lr in lrs}
        best = min(lrs, key=lambda lr: sweep[lr] if math.isfinite(sweep[lr]) else math.inf)
        print(f"[char {steps} steps] {name}: lr sweep {sweep}, best {best:g}")
        for lr, v in sweep.items():
            res.add(name, "val_loss_lr_sweep", "nats/char", v, x_name="lr", x_value=lr, seed=base_seed)
        res.add(name, "best_lr", "lr", best, x_name="steps", x_value=steps)
        finals[name] = [sweep[best]] + [char_run(name, train, vocab, xv, steps, best, s, ctx=ctx)
                                        for s in seed_list[1:]]
        for seed, v in zip(seed_list, finals[name]):
            res.add(name, "val_loss", "nats/char", v, x_name="steps", x_value=steps, seed=seed)
        res.flush()
    base = finals.get("AdamW(fused)")
    for name, vals in finals.items():
        ratios = [v / b for v, b in zip(vals, base)]
        for seed, r in zip(seed_list, ratios):
            res.add(name, "val_loss_vs_adamw", "ratio", r, x_name="steps", x_value=steps, seed=seed)
        mean = statistics.fmean(ratios)
        std = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
        res.add(name, "val_loss_vs_adamw_mean", "ratio", mean, x_name="steps", x_value=steps)
        res.add(name, "val_loss_vs_adamw_std", "ratio", std, x_name="steps", x_value=steps)
        print(f"[char {steps} steps] {name}: val loss {statistics.fmean(vals):.4f} = "
              f"{mean:.4f} +- {std:.4f} x AdamW over {len(vals)} seeds")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every optimizer (ours: as many numba threads)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per optimizer")
    parser.add_argument("--optimizers", nargs="*", default=None, choices=list(OPTIMIZERS),
                        help="default: all; with --quick all but torchao's (each compiles for ~3 min here)")
    parser.add_argument("--skip-loss", action="store_true", help="only memory and step times")
    parser.add_argument("--skip-timing", action="store_true", help="only the character-model loss runs")
    parser.add_argument("--loss-optimizers", nargs="+", default=LOSS_OPTIMIZERS, choices=LOSS_OPTIMIZERS,
                        help="optimizers of the loss runs (AdamW is always run: the ratios need it)")
    parser.add_argument("--seeds", type=int, default=None, help="loss runs per optimizer (default 3; 1 with --quick)")
    parser.add_argument("--lrs", type=float, nargs="+", default=None,
                        help="peak learning-rate grid of every optimizer's loss runs "
                             "(default 1e-3 3e-3 1e-2; 3e-3 with --quick)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.optimizers is None:
        args.optimizers = [n for n in OPTIMIZERS if not (args.quick and n.startswith("torchao"))]
    repeats = args.repeats or (7 if args.quick else 21)
    seeds = args.seeds or (1 if args.quick else 3)
    loss_steps = 200
    lrs = args.lrs or ([3e-3] if args.quick else [1e-3, 3e-3, 1e-2])
    config = dict(vars(args), repeats=repeats, loss_steps=loss_steps, seeds=seeds, lrs=lrs,
                  threads=torch.get_num_threads())
    with Results("gefen_memory", args, config=config) as res:
        if not args.skip_timing:
            for model_name in MODELS:
                memory_and_time(res, model_name, args.optimizers, repeats, args.seed)
                res.flush()
        if not args.skip_loss:
            char_loss(res, ["AdamW(fused)"] + [n for n in args.loss_optimizers if n != "AdamW(fused)"],
                      loss_steps, seeds, lrs, args.seed)
            res.flush()


if __name__ == "__main__":
    main()
