"""Gefen codebook: exact optimum vs brute force and upstream gefen, nearest-code lookup, histogram.

References written here, independent of ``optim/gefen/codebook.py``:
- ``_brute_dp``: the O(B²K) DP over contiguous non-empty groups (upstream gefen's definition), with
  every group cost computed from the bins themselves (shifted sums), no prefix-sum differences;
- ``_brute_nearest_objective``: the optimum when every bin goes to its nearest level and ±1 may
  stay unused by bins (the rule for fewer occupied bins than levels);
- brute-force argmin of |x − c| in float64 for the quantiser; ``torch.histc`` for the histogram.
"""

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from optim.gefen.codebook import code_boundaries, code_table, histogram, nearest_code, optimal_codebook
from tests.utils import assert_close

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ["numpy", "numba"]


# ----------------------------------------------------------------------------------------------
# references


def _cost_matrices(x, w):
    """C[kind][i, j] = weighted squared error of bins i..j-1 against mean / -1 / +1 (inf if i >= j)."""
    n = x.size
    mats = np.full((3, n + 1, n + 1), np.inf)
    for i in range(n):
        xs, ws = x[i:], w[i:]
        s0 = np.cumsum(ws)
        d = xs - xs[0]  # shifted: the mean's error does not cancel catastrophically
        s1 = np.cumsum(ws * d)
        s2 = np.cumsum(ws * d * d)
        mats[0, i, i + 1:] = s2 - s1 * s1 / s0
        for kind, c in ((1, -1.0), (2, 1.0)):
            e = xs - c
            mats[kind, i, i + 1:] = np.cumsum(ws * e * e)
    return mats


def _brute_dp(x, w, levels, fix):
    """min over partitions of sorted bins into `levels` contiguous non-empty groups."""
    n = x.size
    C = _cost_matrices(x, w)
    D = np.full(n + 1, np.inf)
    D[0] = 0.0
    for k in range(1, levels + 1):
        kind = 1 if (fix and k == 1) else 2 if (fix and k == levels) else 0
        D = np.min(D[:, None] + C[kind], axis=0)
    return D[n]


def _brute_nearest_objective(x, w, levels, fix):
    """Optimum of 'each bin to its nearest level' (pinned ±1 may serve no bin)."""
    n = x.size
    C = _cost_matrices(x, w)
    free = levels - 2 if fix else levels
    if not fix:
        return _brute_dp(x, w, min(levels, n), False)
    best = np.inf
    for p in range(0, n + 1):  # bins [0, p) go to -1
        for s in range(p, n + 1):  # bins [s, n) go to +1
            lo = C[1, 0, p] if p > 0 else 0.0
            hi = C[2, s, n] if s < n else 0.0
            m = s - p
            if m == 0:
                best = min(best, lo + hi)
                continue
            g = min(free, m)
            if g == 0:
                continue
            best = min(best, lo + hi + _brute_dp(x[p:s], w[p:s], g, False))
    return best


def _random_hist(rng, n_bins, occupied, integer=True):
    centers = np.sort(rng.uniform(-1, 1, n_bins))
    counts = rng.integers(1, 50, n_bins).astype(np.float64) if integer else rng.uniform(0.01, 3, n_bins)
    zero = rng.choice(n_bins, n_bins - occupied, replace=False)
    counts[zero] = 0.0
    return torch.tensor(centers, dtype=torch.float32), torch.tensor(counts)


def _nearest_error(x, w, codebook):
    c = codebook.double().numpy()
    return float(np.sum(w * np.min((x[:, None] - c[None, :]) ** 2, axis=1)))


def _f64(v):
    return torch.tensor(v, dtype=torch.float64)


def _occ(centers, counts):
    x = centers.double().numpy()
    w = counts.double().numpy()
    keep = w > 0
    return x[keep], w[keep]


# ----------------------------------------------------------------------------------------------
# optimal_codebook


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bins,occupied,levels,fix", [
    pytest.param(5, 5, 2, True, id="B5-K2-pinned"),
    pytest.param(12, 9, 3, True, id="B12-K3-pinned"),
    pytest.param(30, 30, 5, True, id="B30-K5-pinned"),
    pytest.param(30, 22, 5, False, id="B30-K5-free"),
    pytest.param(41, 37, 8, True, id="B41-K8-pinned"),
    pytest.param(25, 25, 1, False, id="B25-K1-free"),
    pytest.param(17, 17, 17, True, id="K-equals-occupied"),
    pytest.param(64, 50, 49, False, id="K-one-below-occupied"),
])
def test_optimal_codebook_matches_brute_force(backend, bins, occupied, levels, fix):
    rng = np.random.default_rng(bins * 100 + levels)
    for trial in range(3):
        centers, counts = _random_hist(rng, bins, occupied, integer=trial != 1)
        cb, cost = optimal_codebook(centers, counts, levels, fix_endpoints=fix, backend=backend)
        x, w = _occ(centers, counts)
        ref = _brute_dp(x, w, levels, fix)
        assert isinstance(cost, float)
        assert_close(_f64(cost), _f64(ref), rtol=1e-9, atol=1e-12, name="cost")
        assert cb.shape == (levels,) and cb.dtype == torch.float32
        assert (cb[1:] > cb[:-1]).all(), cb
        if fix:
            assert cb[0] == -1.0 and cb[-1] == 1.0
        # nearest-level quantisation can only do better than the partition it came from
        assert _nearest_error(x, w, cb) <= cost * (1 + 1e-6) + 1e-9


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("levels,bins,scale", [pytest.param(16, 500, 0.1, id="K16"),
                                               pytest.param(256, 400, 0.3, id="K256")])
def test_optimal_codebook_16_and_256_levels(backend, levels, bins, scale):
    rng = np.random.default_rng(levels)
    # a realistic shape: many small values, few large (like normalised gradients)
    vals = torch.from_numpy(np.clip(rng.laplace(0, scale, 100_000), -1, 1))
    centers, counts = histogram(vals, bins)
    x, w = _occ(centers, counts)
    assert x.size > levels
    for fix in (True, False):
        cb, cost = optimal_codebook(centers, counts, levels, fix_endpoints=fix, backend=backend)
        ref = _brute_dp(x, w, levels, fix)
        assert_close(_f64(cost), _f64(ref), rtol=1e-9, name=f"cost fix={fix}")
        assert cb.numel() == levels and (cb[1:] > cb[:-1]).all()


def test_backends_agree_on_4096_bins():
    rng = np.random.default_rng(7)
    vals = torch.from_numpy(np.clip(rng.standard_t(3, 200_000) * 0.1, -1, 1)).float()
    centers, counts = histogram(vals, 4096)
    a, ca = optimal_codebook(centers, counts, 256, backend="numba")
    b, cb_ = optimal_codebook(centers, counts, 256, backend="numpy")
    assert_close(_f64(ca), _f64(cb_), rtol=1e-12, name="cost")
    assert_close(a, b, atol=1e-6, name="codebook")


def _fixed_level_partition_cost(x, w, levels):
    """min over contiguous non-empty groups of sum_k sum_{bins in k} w (x - levels[k])²."""
    K, n = levels.size, x.size
    D = np.cumsum(w * (x - levels[0]) ** 2)  # k = 0: all bins in group 0
    for k in range(1, K):
        e = w * (x - levels[k]) ** 2
        new = np.full(n, np.inf)
        for j in range(k, n):  # bin j continues group k or starts it
            new[j] = min(new[j - 1], D[j - 1]) + e[j]
        D = new
    return D[n - 1]


@pytest.mark.parametrize("fix", [True, False])
@pytest.mark.parametrize("bins,levels", [(256, 16), (600, 32), (400, 256)])
def test_cost_equals_upstream_exact_dp(fix, bins, levels):
    import gefen.quantization as quant
    rng = np.random.default_rng(bins + levels)
    vals = torch.from_numpy(np.clip(rng.normal(0, 0.25, 60_000), -1, 1)).float()
    centers, counts = histogram(vals, bins)
    occ = counts > 0
    up = quant.exact_dp({"active_centers": centers[occ], "active_counts": counts[occ].float()},
                        levels, force_endpoints=fix)
    ours, cost = optimal_codebook(centers, counts, levels, fix_endpoints=fix)
    x, w = _occ(centers, counts)
    assert x.size >= levels, "the comparison needs at least as many occupied bins as levels"
    up_cost = _fixed_level_partition_cost(x, w, up.double().numpy())
    our_eval = _fixed_level_partition_cost(x, w, ours.double().numpy())
    assert_close(_f64(our_eval), _f64(up_cost), rtol=1e-9, name="cost vs upstream")
    assert_close(_f64(cost), _f64(up_cost), rtol=1e-6, name="returned cost vs upstream")


@pytest.mark.parametrize("fix", [True, False])
@pytest.mark.parametrize("occupied,levels", [(1, 2), (1, 16), (1, 256), (3, 4), (5, 6), (7, 16), (30, 256)])
def test_fewer_occupied_bins_than_levels(fix, occupied, levels):
    if levels < 2 and fix:
        pytest.skip("pinned ends need two levels")
    rng = np.random.default_rng(occupied * 7 + levels)
    for trial in range(3):
        centers, counts = _random_hist(rng, occupied + 3, occupied, integer=trial != 2)
        cb, cost = optimal_codebook(centers, counts, levels, fix_endpoints=fix)
        x, w = _occ(centers, counts)
        assert cb.shape == (levels,) and (cb[1:] > cb[:-1]).all(), cb
        if fix:
            assert cb[0] == -1.0 and cb[-1] == 1.0
        ref = _brute_nearest_objective(x, w, levels, fix)
        assert_close(_f64(cost), _f64(ref), rtol=1e-9, atol=1e-12, name="cost")
        assert_close(_f64(_nearest_error(x, w, cb)), _f64(ref), rtol=1e-6, atol=1e-9,
                     name="nearest-level error of the codebook")


def test_one_bin_and_unsorted_duplicate_centers():
    cb, cost = optimal_codebook(torch.tensor([0.25]), torch.tensor([5.0]), 2)
    assert cb.tolist() == [-1.0, 1.0] and abs(cost - 5 * 0.75 ** 2) < 1e-12
    cb, cost = optimal_codebook(torch.tensor([0.25]), torch.tensor([5.0]), 1, fix_endpoints=False)
    assert cb.tolist() == [0.25] and cost == 0.0
    cb, cost = optimal_codebook(torch.tensor([0.25]), torch.tensor([5.0]), 4, fix_endpoints=True)
    assert cb.tolist() == [-1.0, -0.375, 0.25, 1.0] and cost == 0.0  # -1, the bin, +1, widest-gap midpoint
    # unsorted centres with a duplicate: same answer as the merged, sorted histogram
    c = torch.tensor([0.5, -0.2, 0.5, 0.9, -0.7, 0.1])
    w = torch.tensor([1.0, 2.0, 3.0, 1.0, 5.0, 0.0])
    a, ca = optimal_codebook(c, w, 3)
    b, cb_ = optimal_codebook(torch.tensor([-0.7, -0.2, 0.5, 0.9]), torch.tensor([5.0, 2.0, 4.0, 1.0]), 3)
    assert_close(a, b) and abs(ca - cb_) < 1e-12


@pytest.mark.parametrize("kwargs,match", [
    (dict(levels=0), "levels"),
    (dict(levels=1), "levels must be >= 2"),
    (dict(levels=2.5), "levels"),
    (dict(counts=torch.zeros(4)), "counts has no positive"),
    (dict(counts=torch.tensor([1.0, -1.0, 1.0, 1.0])), "non-negative"),
    (dict(counts=torch.ones(3)), "same length"),
    (dict(centers=torch.tensor([0.0, float("nan"), 0.2, 0.3])), "centers must be finite"),
    (dict(centers=torch.zeros(2, 2)), "centers must be 1-D"),
    (dict(backend="cuda"), "backend"),
    (dict(centers=torch.tensor([-0.5, 0.0, 0.2, 1.5])), r"centers must lie in \[-1, 1\]"),
])
def test_bad_input(kwargs, match):
    args = dict(centers=torch.tensor([-0.5, 0.0, 0.2, 0.3]), counts=torch.ones(4), levels=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        optimal_codebook(**args)


# ----------------------------------------------------------------------------------------------
# nearest_code


def _brute_nearest(x, codebook):
    """argmin_j |x - c_j|, ties to the lower index; near-ties re-decided in exact rationals."""
    xd = x.double().reshape(-1)
    c = codebook.double()
    d = (xd[:, None] - c[None, :]).abs()
    idx = d.argmin(dim=1)
    near = d <= d.min(dim=1, keepdim=True).values + 1e-9
    for r in (near.sum(dim=1) > 1).nonzero().flatten().tolist():
        xf = Fraction(float(xd[r]))
        cands = near[r].nonzero().flatten().tolist()
        idx[r] = min(cands, key=lambda j: (abs(xf - Fraction(float(c[j]))), j))
    return idx.reshape(x.shape)


def _grid_codebook(rng, levels):
    # entries on a 2^-12 grid: every midpoint is exactly representable, so ties really happen
    pts = np.sort(rng.choice(np.arange(-4095, 4096), levels - 2, replace=False)) / 4096.0
    return torch.tensor(np.concatenate([[-1.0], pts, [1.0]]), dtype=torch.float32)


@pytest.mark.parametrize("levels", [2, 3, 16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_nearest_code_matches_argmin(levels, dtype):
    rng = np.random.default_rng(levels)
    cb = _grid_codebook(rng, levels)
    mids = (cb[:-1] + cb[1:]) / 2
    x = torch.cat([
        torch.empty(5000).uniform_(-1.3, 1.3), cb, mids, torch.tensor([-1.0, 1.0, -1e-30, 0.0, 5.0, -7.0]),
        torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0)),
    ]).to(dtype)
    table = code_table(cb)
    assert table.ncmp <= 1
    got = nearest_code(x, table)
    assert got.dtype == torch.int64
    ref = _brute_nearest(x, cb)
    assert torch.equal(got, ref), (x[got != ref][:5], got[got != ref][:5], ref[got != ref][:5])
    even = x.numel() // 2 * 2
    got8 = nearest_code(x[:even].reshape(-1, 2), cb, dtype=torch.uint8)
    assert got8.dtype == torch.uint8 and torch.equal(got8.long(), ref[:even].reshape(-1, 2))


def test_nearest_code_optimal_codebook_and_fallbacks():
    rng = np.random.default_rng(3)
    vals = torch.from_numpy(np.clip(rng.laplace(0, 0.05, 20_000), -1, 1)).float()
    cb, _ = optimal_codebook(*histogram(vals, 4096), 256)
    x = torch.cat([vals, torch.empty(5_000).uniform_(-1.1, 1.1)])
    assert torch.equal(nearest_code(x, cb), _brute_nearest(x, cb))
    # entries closer than any 2^16-bin table can separate: the bucketize fallback, same answers
    close = torch.tensor([-1.0, 0.1, 0.1 + 1e-7, 0.1 + 2e-7, 1.0])
    assert code_table(close).ncmp > 1
    x = torch.cat([torch.empty(2000).uniform_(-1, 1), close, torch.tensor([0.10000005, 0.10000015])])
    assert torch.equal(nearest_code(x, close), _brute_nearest(x, close))
    # a single entry; duplicated entries (the lower index wins)
    assert torch.equal(nearest_code(x, torch.tensor([0.2])), torch.zeros_like(x, dtype=torch.int64))
    dup = torch.tensor([-1.0, 0.0, 0.0, 1.0])
    assert torch.equal(nearest_code(x, dup), _brute_nearest(x, dup))


def test_code_boundaries_round_down():
    cb = torch.tensor([-1.0, 0.1, 0.3, 1.0])
    b = code_boundaries(cb)
    exact = (cb.double()[:-1] + cb.double()[1:]) / 2
    assert (b.double() <= exact).all() and (torch.nextafter(b, torch.tensor(2.0)).double() > exact).all()
    with pytest.raises(ValueError, match="sorted"):
        code_table(torch.tensor([0.5, -0.5]))
    with pytest.raises(ValueError, match="dtype"):
        nearest_code(torch.zeros(3), torch.linspace(-1, 1, 300), dtype=torch.uint8)


# ----------------------------------------------------------------------------------------------
# histogram


@pytest.mark.parametrize("bins", [1, 256, 4096])
def test_histogram_matches_histc(bins):
    k = torch.arange(0, bins + 1, dtype=torch.float64)
    edges = (-1.0 + 2.0 * k / bins).float()  # exact bin edges, ±1 included
    x = torch.cat([torch.empty(100_000).uniform_(-1, 1), edges, torch.tensor([-1.0, 1.0, 0.0])])
    centers, counts = histogram(x, bins)
    assert counts.dtype == torch.int64 and counts.sum() == x.numel()
    assert torch.equal(counts, torch.histc(x, bins=bins, min=-1, max=1).long())
    ref_centers = (torch.linspace(-1, 1, bins + 1, dtype=torch.float64)[:-1] + 1.0 / bins).float()
    assert_close(centers, ref_centers, atol=1e-7, name="centers")
    # outside [-1, 1]: clamped into the end bins (upstream gefen's rule); several tensors summed
    out = torch.tensor([-3.0, 2.0, 1.5])
    _, counts2 = histogram([x, out.double()], bins)
    ref = torch.histc(torch.cat([x, out.clamp(-1, 1)]), bins=bins, min=-1, max=1).long()
    assert torch.equal(counts2, ref)


def test_histogram_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        histogram(torch.tensor([0.0, float("nan")]))
    with pytest.raises(TypeError, match="floating"):
        histogram(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="bins"):
        histogram(torch.zeros(3), bins=0)


@pytest.mark.parametrize("backend", ["auto", "numba"])
def test_without_numba(monkeypatch, backend):
    import optim.gefen.codebook as cbmod

    def missing():
        raise ImportError("No module named 'numba'")

    monkeypatch.setattr(cbmod, "_numba_dp", missing)
    monkeypatch.setattr(cbmod, "_NUMBA_MIN_WORK", 0)  # "auto" would pick numba here
    centers, counts = histogram(torch.empty(5000).uniform_(-1, 1), 512)
    if backend == "numba":
        with pytest.raises(ImportError, match="backend='numpy'"):
            optimal_codebook(centers, counts, 16, backend=backend)
    else:
        _, cost = optimal_codebook(centers, counts, 16, backend=backend)
        x, w = _occ(centers, counts)
        assert_close(_f64(cost), _f64(_brute_dp(x, w, 16, True)), rtol=1e-9, name="cost")


# ----------------------------------------------------------------------------------------------
# the experiment's helpers and rows


def _experiment():
    import experiments.codebook_dp as exp

    return exp


@pytest.mark.parametrize("bits", [4, 8])
def test_dynamic_map_matches_bitsandbytes_definition(bits):
    import ast
    import importlib.util

    spec = importlib.util.find_spec("torchao")  # torchao ships bitsandbytes' definition
    if spec is None:
        pytest.skip("torchao not installed")
    # take just that function from the file: importing torchao (or torch.distributed) takes seconds
    src = (Path(spec.submodule_search_locations[0]) / "optim" / "quant_utils.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "create_dynamic_map")
    ns = {"torch": torch}
    exec(compile(ast.Module([fn], []), "quant_utils.py", "exec"), ns)
    ref = torch.tensor(ns["create_dynamic_map"](signed=True, max_exponent_bits=bits - 1, total_bits=bits))
    assert_close(_experiment().dynamic_map(bits), ref.float(), atol=1e-7, name="dynamic map")


def test_fixed_level_cost_matches_loop():
    rng = np.random.default_rng(11)
    x = np.sort(rng.uniform(-1, 1, 40))
    w = rng.uniform(0.1, 2, 40)
    for K in (1, 2, 7, 40):
        levels = np.sort(rng.uniform(-1, 1, K))
        assert_close(_f64(_experiment().fixed_level_cost(x, w, levels)),
                     _f64(_fixed_level_partition_cost(x, w, levels)), rtol=1e-12, name=f"K={K}")


def test_experiment_rows_tiny(tmp_path):
    import argparse

    from experiments.harness.common import Results, read_results

    exp = _experiment()
    args = argparse.Namespace(quick=True, wandb="disabled", results_dir=tmp_path, seed=0, repeats=None)
    g = [torch.randn(64, 32), torch.randn(32)]
    m = [0.1 * t + 0.01 * torch.randn_like(t) for t in g]
    with Results("codebook_dp", args, config={"tiny": True}) as res:
        exp.quant_errors(res, m, g, [exp.gefen_block(t) for t in g], bits_list=(4,))
        exp.time_dp(res, exp.normalised(g, [256, 256])[0], args, bins_list=[256], levels=(16,))
    rows = read_results("codebook_dp", tmp_path)
    by = {(r["variant"], r["metric"]): r["value"] for r in rows}
    for code in ("learned", "learned-step1", "linear", "dynamic"):
        assert 0 < by[(f"{code}/4bit/absmax256", "rel_mse")] < 1
    # the in-sample optimal code beats the linear one on the data it was fitted to
    assert by[("learned/4bit/absmax256", "nmse")] <= by[("linear/4bit/absmax256", "nmse")]
    assert by[("ours-numba/K16", "cost_rel_diff_vs_upstream")] < 1e-9
    assert by[("upstream/K16", "dp_time")] > 0
