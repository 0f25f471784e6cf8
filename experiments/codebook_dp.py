"""Gefen's codebook: exact DP time and cost against upstream, and quantisation error on real moments.

    python experiments/codebook_dp.py            # full run -> results/codebook_dp.csv
    python experiments/codebook_dp.py --quick    # smaller sizes -> results/quick/
    python analysis/codebook.py                  # paper_figs/codebook.png from the CSV

Part 1, the DP. A character MLP on Python's documentation text (experiments/harness/data.py, no download)
gives its first gradients; block-normalised as Gefen does (block length from upstream gefen's
current rule on g², absmax per block), they are histogrammed with 256 ... 16384 bins. For each
histogram and 16 / 256 levels, ``optim.gefen.codebook.optimal_codebook`` (numba and numpy
backends) and upstream ``gefen.quantization.exact_dp`` run interleaved, warm (compilation
excluded); rows hold median wall and CPU seconds, the speed-up (upstream / ours, medians), and the
DP objective of each result. Upstream returns only a codebook; its objective is evaluated as the
best contiguous non-empty partition against its fixed levels (``fixed_level_cost``), which equals
the DP optimum up to the float32 rounding of the levels. Separately, the first call in a fresh process
(imports plus numba's compile or on-disk cache load) is timed in a subprocess at 4096 x 256
(1024 x 256 with --quick): the DP runs once per training run, so this is what a user waits for.

Part 2, the codes. The same model is trained with ``torch.optim.AdamW`` and its first moments are
taken at the end; each tensor is block-normalised by absmax, either per block of 256 or per
Gefen block (as above; block length 1 uses chunks of 256), and quantised to the nearest entry of:
the learned optimal codebook (fit on these moments, and fit on the step-1 gradients as Gefen does),
a linear code (``linspace(-1, 1, levels)``) and the dynamic-exponent code of bitsandbytes
(``dynamic_map``; 8-bit Dettmers et al., signed, max exponent bits = bits − 1), at 8 and 4 bits.
Rows: relative error sum (m − m̂)² / sum m² and the MSE of the normalised values.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from experiments.harness import data
from experiments.harness import check
from experiments.harness.common import Results, add_common_args
from experiments.harness.train import interleaved
from optim.gefen.codebook import histogram, nearest_code, optimal_codebook

CHUNK = 256  # m-scale block for absmax-256 blocking and for Gefen tensors with block length 1


# ----------------------------------------------------------------------------------------------
# codes


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--bins": [256, 1024, 4096], "--repeats": 3}
CHECK_NOTE = ("histograms of 256, 1,024 and 4,096 bins (the headline's 4,096 included), 3 timed calls a case")


def dynamic_map(bits: int) -> torch.Tensor:
    """bitsandbytes' signed dynamic-exponent code (``create_dynamic_map(signed=True,
    max_exponent_bits=bits - 1, total_bits=bits)``), restated from its definition: for exponent
    i = 0 .. bits − 2, 2^i fraction values (midpoints of linspace(0.1, 1, 2^i + 1)) times
    10^(i − (bits − 2)), both signs, plus 0 and 1. 256 values at 8 bits, 16 at 4 bits."""
    max_exp = bits - 1
    data = []
    for i in range(max_exp):
        edges = np.linspace(0.1, 1.0, 2 ** i + 1)
        means = (edges[:-1] + edges[1:]) / 2.0
        scale = 10.0 ** (-(max_exp - 1) + i)
        data += list(scale * means) + list(-scale * means)
    data += [0.0, 1.0]
    assert len(data) == 2 ** bits
    return torch.tensor(sorted(data), dtype=torch.float32)


def fixed_level_cost(x: np.ndarray, w: np.ndarray, levels: np.ndarray) -> float:
    """min over partitions of the sorted bins into len(levels) contiguous non-empty groups of
    sum_k sum_{bins in group k} w (x − levels[k])²  (upstream's objective for given levels).

    Recursion new[j] = min(new[j−1], D[j−1]) + e_k[j], solved per level with a running minimum.
    """
    n, K = x.size, levels.size
    D = np.cumsum(w * (x - levels[0]) ** 2)
    for k in range(1, K):
        e = w * (x - levels[k]) ** 2
        cs = np.cumsum(e)
        new = np.full(n, np.inf)
        if k < n:
            f = np.minimum.accumulate(D[k - 1:n - 1] - cs[k - 1:n - 1])
            new[k:] = f + cs[k:]
        D = new
    return float(D[n - 1])


# ----------------------------------------------------------------------------------------------
# model, data, moments


def make_model(vocab: int, context: int, width: int):
    return torch.nn.Sequential(
        torch.nn.Embedding(vocab, 32), torch.nn.Flatten(),
        torch.nn.Linear(32 * context, width), torch.nn.GELU(),
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, vocab),
    )


def train(args):
    """AdamW on the character MLP; returns (params, first gradients, final exp_avg, loss curve)."""
    torch.manual_seed(args.seed)
    context, width = 32, (256 if args.quick else 512)
    steps = args.steps or (40 if args.quick else 300)
    ids, vocab = data.encode(data.documentation_text()), data.VOCAB_SIZE
    model = make_model(vocab, context, width)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    g1, losses = None, []
    gen = torch.Generator().manual_seed(args.seed)
    for step in tqdm(range(steps), desc="AdamW on pydoc text", leave=False):
        idx = torch.randint(0, ids.numel() - context - 1, (64,), generator=gen)
        xb = torch.stack([ids[i:i + context] for i in idx.tolist()])
        yb = ids[idx + context]
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if g1 is None:
            g1 = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        losses.append(loss.item())
    params = list(model.parameters())
    m = [opt.state[p]["exp_avg"].detach().clone() for p in params]
    return params, g1, m, losses


def gefen_block(g: torch.Tensor) -> int:
    """Block length of one tensor from its first gradient, by upstream gefen's current rule."""
    from gefen.partitioning import find_period_by_block_variance

    flat = g.detach().float().reshape(-1)
    if flat.numel() < 8:
        return 1
    try:
        return int(find_period_by_block_variance(flat.square().numpy(), print_results=False, backend="cpu"))
    except ValueError:  # too few divisors to score: per-element
        return 1


def block_normalise(t: torch.Tensor, block: int):
    """(t / absmax of its block, per-element scale), flattened; zero blocks stay zero."""
    flat = t.detach().float().reshape(-1)
    n = flat.numel()
    pad = (-n) % block
    v = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    s = v.abs().amax(dim=1, keepdim=True)
    x = torch.where(s > 0, v / s.clamp_min(1e-30), torch.zeros_like(v))
    return x.reshape(-1)[:n], s.expand_as(v).reshape(-1)[:n]


def normalised(tensors, blocks):
    xs, ss = zip(*(block_normalise(t, b) for t, b in zip(tensors, blocks)))
    return torch.cat(xs), torch.cat(ss)


# ----------------------------------------------------------------------------------------------
# part 1: DP timing and cost


def time_dp(res, norm_g1, args, bins_list=None, levels=(16, 256)):
    from gefen.quantization import exact_dp

    if bins_list is None:
        bins_list = args.bins or ([256, 512, 1024] if args.quick else [256, 512, 1024, 2048, 4096, 8192, 16384])
    upstream_max = 1024 if args.quick else 4096
    repeats = args.repeats or (3 if args.quick else 5)
    impls = ["ours-numba", "ours-numpy", "upstream"]
    for bins in tqdm(bins_list, desc="DP timing", leave=False):
        centers, counts = histogram(norm_g1, bins)
        occ = counts > 0
        x, w = centers[occ].double().numpy(), counts[occ].double().numpy()
        for K in levels:
            if occ.sum() < 2 * K:
                continue  # too few occupied bins: upstream pads without a DP
            run = {
                "ours-numba": lambda: optimal_codebook(centers, counts, K, backend="numba"),
                "ours-numpy": lambda: optimal_codebook(centers, counts, K, backend="numpy"),
                "upstream": lambda: (exact_dp({"active_centers": centers[occ],
                                               "active_counts": counts[occ].float()}, K), None),
            }
            active = [i for i in impls if i != "upstream" or bins <= upstream_max]
            out = {i: run[i]() for i in active}  # warm-up: compilation and caches
            times = interleaved({i: run[i] for i in active}, repeats)
            wall = {i: t["wall"] for i, t in times.items()}
            cpu = {i: t["cpu"] for i, t in times.items()}
            up_cost = fixed_level_cost(x, w, out["upstream"][0].double().numpy()) if "upstream" in out else None
            for i in active:
                v = f"{i}/K{K}"
                res.add(v, "dp_time", "s", statistics.median(wall[i]), "bins", bins)
                res.add(v, "dp_cpu_time", "s", statistics.median(cpu[i]), "bins", bins)
                cost = out[i][1] if out[i][1] is not None else up_cost
                res.add(v, "dp_cost", "sum count*err^2", cost, "bins", bins)
                if up_cost is not None and i != "upstream":
                    res.add(v, "speedup_vs_upstream", "x", statistics.median(wall["upstream"]) /
                            statistics.median(wall[i]), "bins", bins)
                    res.add(v, "cpu_speedup_vs_upstream", "x", statistics.median(cpu["upstream"]) /
                            statistics.median(cpu[i]), "bins", bins)
                    res.add(v, "cost_rel_diff_vs_upstream", "1", abs(cost - up_cost) / up_cost, "bins", bins)
            msg = "  ".join(f"{i} {statistics.median(wall[i]) * 1e3:.1f} ms" for i in active)
            tqdm.write(f"bins={bins} K={K}: {msg}")


_COLD = """
import time
t0, c0 = time.perf_counter(), time.process_time()
import torch
from optim.gefen.codebook import histogram
centers, counts = histogram(torch.load({path!r}), {bins})
t1, c1 = time.perf_counter(), time.process_time()
if {impl!r} == "upstream":
    from gefen.quantization import exact_dp
    occ = counts > 0
    exact_dp({{"active_centers": centers[occ], "active_counts": counts[occ].float()}}, {K})
else:
    from optim.gefen.codebook import optimal_codebook
    optimal_codebook(centers, counts, {K}, backend={impl!r}.split("-")[1])
wall, cpu = time.perf_counter() - t1, time.process_time() - c1
from experiments.harness.child import emit_result
emit_result([wall, cpu])
"""


def cold_start(res, norm_g1, args, bins, K):
    """First call in a fresh process (imports, numba's cache load or compile), in a subprocess."""
    import tempfile

    from experiments.harness.child import child_env, run_child

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "values.pt")
        torch.save(norm_g1, path)
        for impl in ("ours-numba", "ours-numpy", "upstream"):
            code = _COLD.format(path=path, bins=bins, K=K, impl=impl)
            run = run_child([sys.executable, "-c", code], env=child_env(), timeout=600)
            if run.result is None:
                tqdm.write(f"cold start of {impl} failed ({run.outcome}): {run.stderr[-500:]}")
                continue
            wall, cpu = run.result
            res.add(f"{impl}/K{K}", "cold_first_call_time", "s", wall, "bins", bins)
            res.add(f"{impl}/K{K}", "cold_first_call_cpu_time", "s", cpu, "bins", bins)
            tqdm.write(f"cold first call, {bins} bins x {K} levels, {impl}: {wall:.2f} s wall, {cpu:.2f} s CPU")


# ----------------------------------------------------------------------------------------------
# part 2: quantisation error of the codes


def quant_errors(res, m, g1, gefen_blocks, bits_list=(8, 4)):
    blockings = {"absmax256": [CHUNK] * len(m), "gefen": [b if b > 1 else CHUNK for b in gefen_blocks]}
    for bname, blocks in blockings.items():
        xm, sm = normalised(m, blocks)
        xg, _ = normalised(g1, blocks)
        m_flat = xm * sm
        denom = float(m_flat.double().square().sum())
        for bits in bits_list:
            K = 2 ** bits
            codes = {
                "learned": optimal_codebook(*histogram(xm, 4096), K)[0],
                "learned-step1": optimal_codebook(*histogram(xg, 4096), K)[0],
                "linear": torch.linspace(-1, 1, K),
                "dynamic": dynamic_map(bits),
            }
            for cname, cb in codes.items():
                q = cb[nearest_code(xm, cb)]
                err = float(((q - xm) * sm).double().square().sum())
                v = f"{cname}/{bits}bit/{bname}"
                res.add(v, "rel_mse", "sum (m-mq)^2 / sum m^2", err / denom)
                res.add(v, "nmse", "mean (x-xq)^2, x block-normalised", float((q - xm).double().square().mean()))
                tqdm.write(f"{v}: rel error {err / denom:.3e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps of the character MLP (300; quick 40)")
    parser.add_argument("--bins", type=int, nargs="+", default=None, help="histogram sizes of the DP timing")
    parser.add_argument("--repeats", type=int, default=None, help="timed DP calls per case (5; quick 3)")
    parser.add_argument("--no-cold-start", action="store_true", help="skip the fresh-process first calls")
    args = check.parse(parser, argv)
    params, g1, m, losses = train(args)
    gefen_blocks = [gefen_block(g) for g in g1]
    cfg = dict(vars(args), model="char MLP (context 32, embed 32)", n_params=sum(p.numel() for p in params),
               gefen_blocks=gefen_blocks, final_loss=losses[-1], first_loss=losses[0], steps=len(losses))
    with Results("codebook_dp", args, config=cfg) as res:
        res.add("AdamW", "train_loss_first", "nats", losses[0])
        res.add("AdamW", "train_loss_last", "nats", losses[-1], "steps", len(losses))
        quant_errors(res, m, g1, gefen_blocks)
        blocks = [b if b > 1 else CHUNK for b in gefen_blocks]
        norm_g1, _ = normalised(g1, blocks)
        time_dp(res, norm_g1, args)
        if not args.no_cold_start:
            cold_start(res, norm_g1, args, 1024 if args.quick else 4096, 256)


if __name__ == "__main__":
    main()
