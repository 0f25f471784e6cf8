"""One table: how far each optimizer is from its independent reference.

    python experiments/correctness.py --quick      # fewer steps, smaller tables; rows into results/quick/
    python experiments/correctness.py              # more steps, larger tables; rows into results/
    python experiments/correctness.py --quick --no-triton                  # torch backends only
    python experiments/correctness.py --quick --checks DiskSparseAdam/triton  # one group

Rows (results/correctness.csv): variant "<ours>[<backend>,...] vs <reference>" with both named as in
experiments/harness/registry.py, metrics ``max_abs_err`` and
``rel_rms_err`` of the weights after N steps from the same start on the same random batches.

- DiskSparseAdam vs torch.optim.SparseAdam (fp32, heavy duplicate indices): the numba backend (the
  CPU default, also with ``bitwise=False``) and the torch backend;
- DiskSparseRiemannianAdam vs geoopt's SparseRiemannianAdam on PoincareBall / PoincareBallExact
  (float64, points up to 0.9 of the radius);
- Gefen with layout="adamw" (its state is AdamW's) vs torch.optim.AdamW;
- the Triton backend vs the torch backend of each optimizer (under TRITON_INTERPRET=1 on CPU; on
  the GPU when CUDA is present).
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import os
import sys

import torch

from experiments.harness import check
from experiments.harness.common import Results, add_common_args
from experiments.harness.registry import make_optimizer


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {}
CHECK_NOTE = ("the full run's size (200 steps, a 5,000 × 64 table): the claim itself")


def _errors(ours, ref):
    a, e = ours.detach().double().cpu(), ref.detach().double().cpu()
    return float((a - e).abs().max()), float((a - e).norm() / e.norm().clamp_min(1e-300))


def _sparse_batches(rows, steps, batch, seed):
    g = torch.Generator().manual_seed(seed)
    # a small "hot" set so indices repeat inside a batch and across steps
    hot = torch.randint(0, rows, (max(2, rows // 8),), generator=g)
    for _ in range(steps):
        yield hot[torch.randint(0, hot.numel(), (batch,), generator=g)]


def _embedding_run(make_opt, weight, steps, batch, seed, loss_fn, device="cpu"):
    emb = torch.nn.Embedding(weight.shape[0], weight.shape[1], sparse=True).to(device=device, dtype=weight.dtype)
    with torch.no_grad():
        emb.weight.copy_(weight)
    opt = make_opt([emb.weight])
    for idx in _sparse_batches(weight.shape[0], steps, batch, seed):
        opt.zero_grad()
        loss_fn(emb(idx.to(device))).backward()
        opt.step()
    if hasattr(opt, "close"):
        opt.close()
    return emb.weight.detach().clone()


def _euclid_loss(x):
    return (x.pow(2).sum(-1) * torch.linspace(0.5, 1.5, x.shape[0], dtype=x.dtype, device=x.device)).mean()


def _ball_loss(x):
    # squared norm pulls to the origin; a pairwise term pushes neighbours apart
    return x.pow(2).sum(-1).mean() - 0.1 * (x[1:] - x[:-1]).pow(2).sum(-1).mean()


def check_dsa(res, steps, rows, dim, backends, device):
    w0 = torch.randn(rows, dim) * 0.1
    ref = _embedding_run(lambda p: make_optimizer("SparseAdam", p, 1e-2), w0, steps, 256, 1, _euclid_loss)
    for backend in backends:
        # numba is the CPU default (bitwise=False: its faster variant with a correctly rounded sqrt)
        for bitwise in ((True, False) if backend == "numba" else (True,)):
            ours = _embedding_run(lambda p: make_optimizer("DiskSparseAdam", p, 1e-2, backend=backend, bitwise=bitwise),
                                  w0, steps, 256, 1, _euclid_loss, device=device if backend == "triton" else "cpu")
            name = backend + ("" if bitwise else ",bitwise=False")
            yield res, f"DiskSparseAdam[{name}] vs SparseAdam", ours, ref, steps


def check_riemannian(res, steps, rows, dim, backends, device):
    import geoopt

    for exact in (False, True):
        for c in (1.0, 0.5):
            g = torch.Generator().manual_seed(2)
            w0 = torch.randn(rows, dim, generator=g, dtype=torch.float64)
            radius = torch.rand(rows, 1, generator=g, dtype=torch.float64) * 0.9 / c**0.5
            w0 = w0 / w0.norm(dim=-1, keepdim=True) * radius
            # geoopt keeps c as a float32 tensor unless given one of float64 (1e-9 drift at c=0.5)
            c64 = torch.tensor(c, dtype=torch.float64)
            ball = geoopt.PoincareBallExact(c=c64) if exact else geoopt.PoincareBall(c=c64)
            emb = torch.nn.Embedding(rows, dim, sparse=True).double()
            emb.weight = geoopt.ManifoldParameter(w0.clone(), manifold=ball)
            ropt = make_optimizer("geoopt-SparseRiemannianAdam", [emb.weight], 1e-2)
            for idx in _sparse_batches(rows, steps, 128, 3):
                ropt.zero_grad()
                _ball_loss(emb(idx)).backward()
                ropt.step()
            ref = emb.weight.detach().clone()
            for backend in backends:
                dt = torch.float64 if backend == "torch" else torch.float32
                ours = _embedding_run(
                    lambda p: make_optimizer("DiskSparseRiemannianAdam", p, 1e-2, c=c, exact=exact, backend=backend),
                    w0.to(dt), steps, 128, 3, _ball_loss, device=device if backend == "triton" else "cpu")
                name = f"DiskSparseRiemannianAdam[{backend},{'exact' if exact else 'retr'},c={c:g},{str(dt)[6:]}]"
                yield res, f"{name} vs geoopt-SparseRiemannianAdam", ours, ref, steps


def _dense_problem(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 10))
    data = [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(8)]
    return model.to(device), [(x.to(device), y.to(device)) for x, y in data]


def _dense_run(make_opt, steps, seed, device="cpu"):
    torch.manual_seed(seed)
    model, data = _dense_problem(seed, device)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = make_opt([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}])
    for t in range(steps):
        x, y = data[t % len(data)]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])


def check_gefen(res, steps, backends, device):
    ref = _dense_run(lambda g: make_optimizer("AdamW", g, 1e-3), steps, 4)
    ours = _dense_run(lambda g: make_optimizer("Gefen-8bit", g, 1e-3, layout="adamw"), steps, 4)
    yield res, "Gefen[reduction] vs AdamW", ours, ref, steps
    if "triton" in backends:
        for bits in (8, 4):
            name = f"Gefen-{bits}bit"
            torch_run = _dense_run(lambda g: make_optimizer(name, g, 1e-3, backend="torch"), steps, 5, device)
            triton_run = _dense_run(lambda g: make_optimizer(name, g, 1e-3, backend="triton"), steps, 5, device)
            yield res, f"{name}[triton] vs {name}[torch]", triton_run, torch_run, steps


CHECKS = ["DiskSparseAdam", "DiskSparseAdam/triton", "DiskSparseRiemannianAdam", "DiskSparseRiemannianAdam/triton",
          "Gefen"]


def main(argv=None):
    parser = add_common_args(argparse.ArgumentParser(description=__doc__,
                                                     formatter_class=argparse.RawDescriptionHelpFormatter),
                             check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--no-triton", action="store_true", help="skip the Triton backend comparisons")
    parser.add_argument("--checks", nargs="+", default=None, choices=CHECKS,
                        help="run only these groups of comparisons (Default: all)")
    args = check.parse(parser, argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported
    device = "cuda" if cuda else "cpu"
    steps = 20 if args.quick else 200
    rows, dim = (500, 16) if args.quick else (5000, 64)
    backends = ["torch"] + ([] if args.no_triton else ["triton"])
    tri_steps = 5 if (args.quick and not cuda) else steps

    table = []
    with Results("correctness", args, config=vars(args), device=device) as res:
        checks = [
            ("DiskSparseAdam", lambda: check_dsa(res, steps, rows, dim, ["numba", "torch"], device)),
            ("DiskSparseAdam/triton", lambda: check_dsa(res, tri_steps, rows, dim, backends[1:], device)),
            ("DiskSparseRiemannianAdam", lambda: check_riemannian(res, steps, rows // 5, dim, ["torch"], device)),
            ("DiskSparseRiemannianAdam/triton",
             lambda: check_riemannian(res, tri_steps, rows // 5, dim, backends[1:], device)),
            ("Gefen", lambda: check_gefen(res, steps // 2 if args.quick else 50, backends, device)),
        ]
        for label, run in checks:
            if args.checks and label not in args.checks:
                continue
            try:
                for r, variant, ours, ref, n in run():
                    mx, rr = _errors(ours, ref)
                    r.add(variant, "max_abs_err", "abs", mx, x_name="steps", x_value=n)
                    r.add(variant, "rel_rms_err", "rel", rr, x_name="steps", x_value=n)
                    table.append((variant, n, mx, rr))
            except ImportError as exc:  # a missing optional peer; real errors must surface
                print(f"[correctness] skipped {label}: {type(exc).__name__}: {exc}", file=sys.stderr)
    width = max([len("comparison")] + [len(t[0]) for t in table])
    print(f"\n{'comparison':<{width}} {'steps':>5} {'max|Δ|':>10} {'rel RMS':>10}")
    for variant, n, mx, rr in table:
        print(f"{variant:<{width}} {n:>5} {mx:>10.2e} {rr:>10.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
