"""experiments/hessian_alignment.py: the Hessian, the pair and block statistics, the block schemes and
the shared-second-moment Adam, each against an independent restatement; the --quick entry on a tiny
size; the analysis script on a fixture CSV."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from experiments import hessian_alignment as ha
from experiments.harness._hessian_blocks import SharedVAdam, adam_mini_ids, block_stats, scheme_ids
from experiments.harness._hessian_models import FlatModel, build_model, hessian, load_text_ids, minibatch_grads, sample_batch
from experiments.harness.common import FIELDS, read_results
from tests.utils import assert_close

REPO = Path(__file__).resolve().parents[1]
TINY_T = dict(ctx=4, d_model=4, n_heads=2, d_ff=4)
TINY_M = dict(context=2, hidden=4)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread avoids thread-pool overhead that would dominate their ops."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny(kind, vocab=5, seed=0, dtype=torch.float64):
    size = TINY_T if kind == "transformer" else TINY_M
    fm = FlatModel(build_model(kind, vocab, size, seed).to(dtype))
    train, _, _ = load_text_ids(vocab)
    length = 4 if kind == "transformer" else 5
    x, y = sample_batch(train, 3, length, torch.Generator().manual_seed(seed))
    return fm, fm.initial(dtype), x, y


@pytest.mark.parametrize("kind", ["transformer", "mlp"])
def test_hessian_matches_double_loop_and_finite_differences(kind):
    fm, p, x, y = _tiny(kind)
    p = p + 0.1 * torch.randn_like(p)  # away from the symmetric init
    H = hessian(fm, p, x, y, chunk=128)  # 2 chunks: covers the chunked path
    assert H.shape == (fm.n, fm.n)
    # brute force: one reverse pass per row of the gradient (reverse over reverse), 48 random rows
    q = p.clone().requires_grad_()
    g = torch.autograd.grad(fm.loss(q, x, y), q, create_graph=True)[0]
    some = torch.randperm(fm.n)[:48]
    rows = torch.stack([torch.autograd.grad(g[i], q, retain_graph=True)[0] for i in some.tolist()])
    assert_close(H[some], rows, atol=1e-10, rtol=1e-8, name=f"{kind} Hessian vs double loop")
    # central differences of the gradient on a few random columns
    cols = torch.randperm(fm.n)[:12]
    h = 1e-5

    def gradient(v):
        v = v.clone().requires_grad_()
        return torch.autograd.grad(fm.loss(v, x, y), v)[0]

    for j in cols.tolist():
        e = torch.zeros_like(p)
        e[j] = h
        fd = (gradient(p + e) - gradient(p - e)) / (2 * h)
        assert_close(H[:, j], fd, atol=1e-6, rtol=1e-5, name=f"{kind} Hessian column {j} vs finite differences")


def test_minibatch_grads_match_loop():
    fm, p, _, _ = _tiny("transformer")
    train, _, _ = load_text_ids(5)
    gen = torch.Generator().manual_seed(3)
    xy = [sample_batch(train, 2, 4, gen) for _ in range(3)]
    xs, ys = torch.stack([a for a, _ in xy]), torch.stack([b for _, b in xy])
    G = minibatch_grads(fm, p, xs, ys)
    for k in range(3):
        q = p.clone().requires_grad_()
        ref = torch.autograd.grad(fm.loss(q, xs[k], ys[k]), q)[0]
        assert_close(G[k], ref, atol=1e-12, rtol=1e-10, name=f"minibatch {k} gradient")


def test_pair_matrices_against_per_pair_loop():
    n, K = 7, 9
    A = torch.randn(n, n, dtype=torch.float64)
    H = A + A.T
    G = torch.randn(K, n, dtype=torch.float64)
    G[2, 4] = 0.0  # entry 4 gets a zero gradient once: inactive
    coupling, spread, level, gcorr, active = ha.pair_matrices(H, G)
    assert active.tolist() == [i != 4 for i in range(n)]
    for i in range(n):
        for j in range(n):
            if not (active[i] and active[j]):
                assert math.isnan(coupling[i, j]) and math.isnan(spread[i, j])
                continue
            c = abs(H[i, j]) / math.sqrt(abs(H[i, i] * H[j, j]))
            s = torch.log(G[:, i] ** 2 / G[:, j] ** 2).std()  # unbiased, over minibatches
            lv = abs(math.log(float((G[:, i] ** 2).mean() / (G[:, j] ** 2).mean())))
            r = abs(np.corrcoef(G[:, i].numpy(), G[:, j].numpy())[0, 1])
            assert abs(coupling[i, j] - c) <= 1e-12 * max(1, c)
            assert abs(spread[i, j] - s) <= 1e-9
            assert abs(level[i, j] - lv) <= 1e-9
            assert abs(gcorr[i, j] - r) <= 1e-9


def test_spearman_matches_scipy_with_ties():
    a = torch.randint(0, 5, (200,)).double()
    b = a + torch.randn(200, dtype=torch.float64)
    assert abs(ha.spearman(a, b) - spearmanr(a.numpy(), b.numpy())[0]) < 1e-12


def test_block_stats_against_brute_force():
    n = 10
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
    coupling = torch.rand(n, n, dtype=torch.float64)
    spread = torch.rand(n, n, dtype=torch.float64)
    v = torch.rand(n, dtype=torch.float64) + 0.1
    active = torch.ones(n, dtype=torch.bool)
    active[8] = False
    out = block_stats(ids, coupling, spread, v, active)
    cs, ss, disp = [], [], []
    for i in range(n):
        if not active[i]:
            continue
        mates = [j for j in range(n) if j != i and ids[j] == ids[i] and active[j]]
        members = [j for j in range(n) if ids[j] == ids[i]]
        disp.append(math.log(v[i] / v[members].mean()))
        if mates:
            cs.append(float(coupling[i, mates].mean()))
            ss.append(float(spread[i, mates].mean()))
    assert abs(out["coupling_within"] - np.mean(cs)) < 1e-12
    assert abs(out["spread_within"] - np.mean(ss)) < 1e-12
    assert abs(out["dispersion"] - math.sqrt(np.mean(np.square(disp)))) < 1e-12
    assert out["n_blocks"] == 4 and abs(out["frac_shared"] - 0.9) < 1e-12


def test_shared_v_per_element_is_torch_adamw():
    p0 = torch.randn(57)
    grads = [torch.randn(57) for _ in range(50)]
    ours, ref = p0.clone(), p0.clone().requires_grad_()
    opt = SharedVAdam(torch.arange(57), lr=1e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    topt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    for g in grads:
        opt.step(ours, g)
        ref.grad = g.clone()
        topt.step()
    # not bitwise: sqrt(v/bc2) here vs sqrt(v)/sqrt(bc2) in torch
    assert_close(ours, ref.detach(), atol=1e-6, rtol=1e-6, name="SharedVAdam per element vs AdamW")


def test_shared_v_blocks_against_restatement():
    ids = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    p, g_all = torch.randn(7), [torch.randn(7) for _ in range(5)]
    opt = SharedVAdam(ids, lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    ours = p.clone()
    m, v = [0.0] * 7, [0.0] * 3
    ref = p.double().tolist()
    for t, g in enumerate(g_all, 1):
        opt.step(ours, g)
        for b in range(3):
            mem = [i for i in range(7) if ids[i] == b]
            v[b] = 0.99 * v[b] + 0.01 * sum(float(g[i]) ** 2 for i in mem) / len(mem)
        for i in range(7):
            m[i] = 0.9 * m[i] + 0.1 * float(g[i])
            ref[i] -= 3e-3 * (m[i] / (1 - 0.9 ** t)) / (math.sqrt(v[ids[i]] / (1 - 0.99 ** t)) + 1e-8)
    assert_close(ours, torch.tensor(ref), atol=1e-6, rtol=1e-6, name="shared v vs restatement")


def test_factored_shared_v_equals_gefen_reference_unquantised():
    """SharedVAdam with ``factor_ids("gefen_factored")`` on a two-tensor vector equals Gefen's
    reference step with the factor and an unquantised first moment, tensor by tensor, on the
    blocks Gefen's rule picks from the first gradient."""
    from experiments.harness._hessian_blocks import factor_ids, gefen_lengths
    from optim.gefen import reference as R

    slices = [("a", (16, 32), slice(0, 512)), ("b", (12, 24), slice(512, 800))]
    gen = torch.Generator().manual_seed(3)
    # magnitudes that change row by row, nearly constant along a row: the rule picks rows
    first = torch.cat([(10 ** (torch.rand(s[0], 1, generator=gen) * 4 - 2)
                        * (1 + 0.1 * torch.randn(s, generator=gen))).reshape(-1) for _, s, _ in slices])
    lengths = gefen_lengths(slices, first, "adjacent_log")
    assert all(p > 1 for p in lengths), lengths
    fids, ftensor = factor_ids("gefen_factored", slices, first_grad=first)
    ids = scheme_ids("gefen_factored", slices, first_grad=first)
    base = 0
    for (_, _, sl), P in zip(slices, lengths):  # one factor per (tensor, offset in the block)
        assert torch.equal(fids[sl], base + torch.arange(sl.stop - sl.start) % P)
        base += P
    p = torch.randn(800)
    opt = SharedVAdam(ids, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, factors=(fids, ftensor))
    ours, refs = p.clone(), {}
    for t in range(1, 6):
        g = torch.randn(800, generator=gen) * torch.rand(800, generator=gen)
        opt.step(ours, g)
        for (name, _, sl), P in zip(slices, lengths):
            n = sl.stop - sl.start
            x, v, w, m = refs.get(name, (p[sl], torch.zeros(n // P), torch.zeros(P), torch.zeros(n)))
            x, v, _, m, w = R.gefen_step(x, g[sl], v, torch.zeros(0), m, None, step=t, lr=1e-2, beta1=0.9,
                                         beta2=0.99, eps=1e-8, weight_decay=0.1, block=P, bits=8, w=w)
            refs[name] = (x, v, w, m)
    want = torch.cat([refs["a"][0], refs["b"][0]])
    assert_close(ours, want, atol=1e-6, rtol=1e-5, name="factored SharedVAdam vs Gefen reference")


def test_adam_mini_blocks_reproduce_adam_mini_package():
    from adam_mini import Adam_mini

    size = dict(ctx=4, d_model=8, n_heads=2, d_ff=8)
    model = build_model("transformer", 6, size, 0)
    fm = FlatModel(model)
    train, _, _ = load_text_ids(6)
    ids = adam_mini_ids(fm.tensor_slices(), n_heads=2, d_model=8)
    ref = Adam_mini(model.named_parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                    dim=8, n_heads=2, verbose=False)
    flat = fm.initial()
    ours = SharedVAdam(ids, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = sample_batch(train, 3, 4, gen)
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 6), y.reshape(-1))
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        ref.step()
        ours.step(flat, g)
        # keep both on the same trajectory: the next gradient is taken at the package's parameters
        assert_close(flat, fm.initial(), atol=1e-6, rtol=1e-5, name="Adam-mini blocks vs adam_mini package")
        flat = fm.initial()


def test_gefen_schemes_use_partition_and_random_keeps_sizes():
    from optim.gefen.partition import choose_block

    fm = FlatModel(build_model("mlp", 16, dict(context=3, hidden=32), 0))
    train, _, _ = load_text_ids(16)
    x, y = sample_batch(train, 8, 8, torch.Generator().manual_seed(0))
    g = minibatch_grads(fm, fm.initial(), x[None], y[None])[0]
    for rule, name in (("adjacent_log", "gefen"), ("variance_drop", "gefen_var")):
        ids = scheme_ids(name, fm.tensor_slices(), first_grad=g)
        rnd = scheme_ids("random_" + name, fm.tensor_slices(), first_grad=g, seed=5)
        for tname, shape, sl in fm.tensor_slices():
            P = choose_block(g[sl].view(shape), rule=rule)
            seg = ids[sl] - ids[sl].min()
            assert torch.equal(seg, torch.arange(sl.stop - sl.start) // P), tname
            assert set(rnd[sl].tolist()) == set(ids[sl].tolist()), tname
            assert torch.equal(torch.bincount(rnd[sl] - ids[sl].min()), torch.bincount(seg)), tname


def test_unknown_scheme_and_missing_grad_raise():
    fm = FlatModel(build_model("mlp", 5, TINY_M, 0))
    with pytest.raises(ValueError, match="unknown block scheme"):
        scheme_ids("nope", fm.tensor_slices())
    with pytest.raises(ValueError, match="first_grad"):
        scheme_ids("gefen", fm.tensor_slices())


TINY_SET = ["vocab=6", "ctx=4", "d_model=4", "d_ff=4", "context=2", "hidden=4", "batch=4",
            "probe_batches=4", "steps=4", "checkpoints=2", "seeds=1"]


def test_quick_entry_writes_well_formed_rows(tmp_path):
    threads = torch.get_num_threads()
    try:
        argv = ["--quick", "--wandb", "disabled", "--results-dir", str(tmp_path)]
        for kv in TINY_SET:
            argv += ["--set", kv]
        assert ha.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    rows = read_results("hessian_alignment", tmp_path)
    assert rows and all(set(r) == set(FIELDS) for r in rows)
    assert all(r["experiment"] == "hessian_alignment" for r in rows)
    metrics = {(r["variant"], r["metric"]) for r in rows}
    for kind in ("transformer", "mlp"):
        assert (kind, "spearman_spread") in metrics
        assert (f"{kind}/step4", "spread_median") in metrics
        for s in ("adamw",) + ha.LOSS_SCHEMES:
            assert (f"{kind}/{s}", "val_loss") in metrics
        for s in ha.BLOCK_SCHEMES:
            assert (f"{kind}/{s}", "dispersion") in metrics
    for r in rows:
        if r["metric"] in ("val_loss", "spread_median", "dispersion", "hessian_seconds"):
            assert math.isfinite(r["value"]) and r["value"] >= 0, r
        if r["metric"].startswith("spearman") and math.isfinite(r["value"]):
            assert -1 <= r["value"] <= 1, r
    assert (tmp_path / "hessian_alignment.config.json").exists()
    # the AdamW member of the stacked training run is torch.optim.AdamW trained on its own
    cfg = dict(ha.QUICK, **{k: int(v) for k, v in (kv.split("=") for kv in TINY_SET)})
    train, val, _ = load_text_ids(cfg["vocab"])
    for kind in ("transformer", "mlp"):
        fm = FlatModel(build_model(kind, cfg["vocab"], ha.model_size(cfg, kind), 0))
        tx, ty = ha.batches(train, cfg, kind, cfg["steps"], 20_000)
        flat = fm.initial().requires_grad_()
        opt = torch.optim.AdamW([flat], lr=cfg["lr"], weight_decay=0.01)
        for x, y in zip(tx, ty):
            opt.zero_grad()
            fm.loss(flat, x, y).backward()
            opt.step()
        ref = ha.eval_loss(fm, flat.detach(), *ha.batches(val, cfg, kind, 16, 30_000))
        got = [r["value"] for r in rows if r["variant"] == f"{kind}/adamw" and r["metric"] == "val_loss"]
        assert len(got) == 1 and abs(got[0] - ref) <= 1e-5 * ref, (kind, got, ref)


def test_bad_setting_is_named():
    with pytest.raises(SystemExit, match="unknown setting 'nope'"):
        ha.main(["--quick", "--wandb", "disabled", "--set", "nope=3"])


def _fixture_csv(path: Path):
    from experiments.harness.common import Results

    class A:
        results_dir, seed, wandb = path, 0, "disabled"

    with Results("hessian_alignment", A(), config={}) as res:
        for kind in ("transformer", "mlp"):
            for step in (0, 10):
                for d in range(1, 11):
                    res.add(f"{kind}/step{step}", "coupling_median", "", 0.01 * d, "coupling_decile", d)
                    res.add(f"{kind}/step{step}", "spread_median", "", 3 - 0.1 * d, "coupling_decile", d)
                    res.add(f"{kind}/step{step}", "level_median", "", 1.0, "coupling_decile", d)
                res.add(kind, "spearman_spread", "", -0.1, "step", step)
                for s in ("per_element",) + ha.BLOCK_SCHEMES:
                    for m in ("coupling_within", "dispersion", "spread_within"):
                        res.add(f"{kind}/{s}", m, "", 0.5, "step", step)
            for seed in (0, 1):
                for s in ("adamw",) + ha.BLOCK_SCHEMES:
                    res.add(f"{kind}/{s}", "val_loss", "nats", 2.0 + 0.01 * seed, "steps", 10, seed=seed)


def _analysis(results, out):
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(REPO / "analysis" / "hessian_alignment.py"), "--results-dir",
                           str(results), "--out", str(out)], capture_output=True, text=True, timeout=120)


def test_analysis_draws_figure_from_fixture(tmp_path):
    _fixture_csv(tmp_path)
    out = tmp_path / "fig.png"
    proc = _analysis(tmp_path, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_analysis_names_missing_csv(tmp_path):
    proc = _analysis(tmp_path, tmp_path / "x.png")
    assert proc.returncode != 0 and "hessian_alignment.csv" in proc.stdout + proc.stderr
