"""The experiment harness, every experiment at a tiny size, and reproduce.py's command assembly.

Each experiment runs in-process (its ``main``) on the smallest size its flags allow, into tmp_path;
the CSV must have docs/DESIGN.md's columns, the expected variants (registry names) and metrics, finite
values, and the numbers that can be restated independently (state bytes of AdamW, SparseAdam's RAM
state, the reconstruction metrics of Nickel & Kiela 2017) must match that restatement. Where an
experiment has a figure, its analysis script draws it from the tiny CSV.
"""

from __future__ import annotations

import csv
import os
import importlib
import inspect
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from experiments.harness.common import FIELDS, read_results
from experiments.harness.registry import GEFEN_X_DIR

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _main(module, argv, monkeypatch):
    """Run ``module.main`` in this process with ``argv``; torch's thread count is restored after."""
    mod = importlib.import_module(module)
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", [module.replace(".", "/") + ".py", *map(str, argv)])
    try:
        if inspect.signature(mod.main).parameters:
            return mod.main([str(a) for a in argv])
        return mod.main()
    finally:
        torch.set_num_threads(threads)


def _analysis(name, results, out):
    """Run analysis/<name>.py by its command-line interface (the one reproduce.py uses)."""
    import subprocess

    proc = subprocess.run([sys.executable, str(REPO / "analysis" / f"{name}.py"), "--results-dir", str(results),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"analysis/{name}.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def _rows(path, experiment):
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    assert header == FIELDS, f"{path}: columns {header} != docs/DESIGN.md's {FIELDS}"
    rows = read_results(path)
    assert rows, f"{path}: no rows"
    for r in rows:
        assert r["experiment"] == experiment, r
        assert math.isfinite(r["value"]), f"{path}: non-finite value in {r}"
        assert r["torch_version"] == torch.__version__ and r["timestamp"] and r["device"], r
    return rows


def _value(rows, variant, metric, x_value=None):
    hits = [r["value"] for r in rows if r["variant"] == variant and r["metric"] == metric
            and (x_value is None or r["x_value"] == x_value)]
    assert len(hits) == 1, f"expected one {variant}/{metric} row at {x_value}, found {len(hits)}"
    return hits[0]


def _assert_png(path):
    assert path.exists(), f"{path} was not written"
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert path.stat().st_size > 5000, f"{path} is suspiciously small"


# ------------------------------------------------------------------------------------ poincare
def _brute_reconstruction(x, rel, dist):
    """Nickel & Kiela 2017, reconstruction: for every u and every v related to u (v != u), the rank of
    d(u, v) among d(u, v) and the distances to all classes unrelated to u; and per u the average
    precision of its related classes in the ranking of all other classes by distance."""
    n = len(x)
    ranks, aps = [], []
    for u in range(n):
        others = [w for w in range(n) if w != u]
        related = [v for v in others if rel[u][v]]
        d = {w: dist(x[u], x[w]) for w in others}
        for v in related:
            ranks.append(1 + sum(1 for w in others if not rel[u][w] and d[w] < d[v]))
        if related:
            precisions = [sum(1 for w in related if d[w] <= d[v]) / sum(1 for w in others if d[w] <= d[v])
                          for v in related]
            aps.append(sum(precisions) / len(precisions))
    return sum(ranks) / len(ranks), sum(aps) / len(aps)


def _ball_dist(a, b):  # c = 1, written out: arcosh(1 + 2|a-b|^2 / ((1-|a|^2)(1-|b|^2)))
    sq = lambda v: sum(t * t for t in v)  # noqa: E731
    return math.acosh(1 + 2 * sq([p - q for p, q in zip(a, b)]) / ((1 - sq(a)) * (1 - sq(b))))


def _euclid_dist(a, b):
    return math.sqrt(sum((p - q) ** 2 for p, q in zip(a, b)))


@pytest.mark.parametrize("geometry", ["ball", "euclidean"])
def test_poincare_reconstruction_matches_brute_force(geometry):
    from experiments import poincare as exp

    n, dim = 23, 3
    x = torch.randn(n, dim, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True) * torch.rand(n, 1, dtype=torch.float64) * 0.9
    rel = torch.rand(n, n) < 0.25
    rel = rel | rel.T
    rel.fill_diagonal_(True)
    rel[5, :] = False  # a class related to nothing else: no rank, no AP
    rel[:, 5] = False
    rel[5, 5] = True
    pairwise = exp.ball_pairwise(1.0) if geometry == "ball" else exp.euclidean_pairwise
    mean_rank, mean_ap = exp.reconstruction(x, rel, pairwise, chunk=7)  # chunks that do not divide n
    want_rank, want_ap = _brute_reconstruction(x.tolist(), rel.tolist(),
                                               _ball_dist if geometry == "ball" else _euclid_dist)
    assert mean_rank == pytest.approx(want_rank, rel=1e-12), (mean_rank, want_rank)
    assert mean_ap == pytest.approx(want_ap, rel=1e-12), (mean_ap, want_ap)


def test_poincare_related_matrix_is_the_symmetric_closure():
    from experiments.harness.data import related_matrix

    edges = torch.tensor([[0, 1], [1, 2], [0, 2]])
    rel = related_matrix(4, edges)
    want = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(rel, want)


@pytest.mark.timeout(180)
def test_poincare_tiny_run_and_figure(tmp_path, monkeypatch):
    from experiments.poincare import VARIANTS

    _main("experiments.poincare", ["--modules", "numbers", "collections.abc", "--dims", 2, 3, "--epochs", 2,
                                   "--burnin", 1, "--results-dir", tmp_path], monkeypatch)
    rows = _rows(tmp_path / "poincare.csv", "poincare")
    assert (tmp_path / "poincare.config.json").exists()
    assert {r["variant"] for r in rows} == set(VARIANTS)
    assert {r["metric"] for r in rows} == {"mean_rank", "map", "final_loss", "train_time"}
    assert {r["x_value"] for r in rows} == {2.0, 3.0} and {r["x_name"] for r in rows} == {"dim"}
    for r in rows:
        if r["metric"] == "map":
            assert 0 < r["value"] <= 1, r
        if r["metric"] == "mean_rank":
            assert r["value"] >= 1, r
    # ours and geoopt ran from the same start on the same batches: the same embedding to ~1e-12,
    # so the same reconstruction quality
    for dim in (2.0, 3.0):
        for metric in ("mean_rank", "map"):
            ours = _value(rows, "DiskSparseRiemannianAdam", metric, dim)
            ref = _value(rows, "geoopt-SparseRiemannianAdam", metric, dim)
            assert ours == pytest.approx(ref, abs=0.05), (metric, dim, ours, ref)
    out = tmp_path / "figs" / "poincare.png"
    _analysis("poincare", tmp_path, out)
    _assert_png(out)


# ---------------------------------------------------------------------------- dsa_throughput
@pytest.mark.timeout(180)
def test_dsa_throughput_smallest_run(tmp_path, monkeypatch):
    _main("experiments.dsa_throughput", ["--quick", "--configs", "kg", "--rows", 20_000, "--reps", 1, "--steps", 1,
                                         "--cold-steps", 1, "--disk-reads", 10, "--results-dir", tmp_path,
                                         "--state-dir", tmp_path],
          monkeypatch)
    rows = _rows(tmp_path / "dsa_throughput.csv", "dsa_throughput")
    assert {r["x_value"] for r in rows} == {"kg"}
    for v in ("ceiling", "SparseAdam", "DiskSparseAdam/warm", "DiskSparseAdam/cold"):
        for metric in ("throughput", "throughput_per_cpu_second"):
            assert _value(rows, f"kg/{v}", metric) > 0
    # SparseAdam keeps exp_avg and exp_avg_sq in fp32 for both tables (20k entities + 1000 relations, dim 64)
    want_ram = 2 * (20_000 + 1000) * 64 * 4
    assert _value(rows, "kg/SparseAdam", "state_bytes_in_ram") == want_ram
    assert _value(rows, "kg/DiskSparseAdam", "bytes_on_disk") >= want_ram
    assert _value(rows, "kg/disk", "random_read_4KiB") > 0 and _value(rows, "kg/disk", "cold_bound") > 0
    ratio = _value(rows, "kg/ratio", "DiskSparseAdam_warm/SparseAdam")
    assert ratio == pytest.approx(_value(rows, "kg/DiskSparseAdam/warm", "throughput")
                                  / _value(rows, "kg/SparseAdam", "throughput"), rel=1e-9)
    assert not list(tmp_path.glob("dsa-bench-*")), "the state files' temporary directory was left behind"


# ---------------------------------------------------------------------------- dsa_distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dsa_distributed_smallest_run(tmp_path, monkeypatch):
    _main("experiments.dsa_distributed", ["--quick", "--rows", 2000, "--dim", 8, "--batch", 64, "--steps", 2,
                                          "--reps", 1, "--warmup", 1, "--backend", "torch", "--results-dir", tmp_path,
                                          "--state-dir", tmp_path, "--timeout", 150], monkeypatch)
    rows = _rows(tmp_path / "dsa_distributed.csv", "dsa_distributed")
    for variant, ranks in (("single", 1), ("sharded", 1), ("ddp", 1), ("sharded", 2), ("ddp", 2)):
        assert _value(rows, variant, "throughput", ranks) > 0
    assert _value(rows, "sharded", "bytes_per_step", 1) == 0 and _value(rows, "ddp", "bytes_per_step", 1) == 0
    # 2 ranks, 64 of 2000 rows each: about half of a rank's ~63 unique rows live on the other rank,
    # each costing an 8-byte id, a 32-byte gradient row and (served the other way) a 32-byte row
    assert 16 + 20 * 72 < _value(rows, "sharded", "bytes_per_step", 2) < 16 + 45 * 72
    # on paper, 512 ranks of the seed setup: unique rows of 2048 uniform draws from 1M, counted here
    gen = torch.Generator().manual_seed(0)
    uniq = sum(torch.unique(torch.randint(0, 10**6, (2048,), generator=gen)).numel() for _ in range(50)) / 50
    paper = _value(rows, "paper/sharded", "bytes_per_step", 512)
    assert paper == pytest.approx(64 * 511 + uniq * 511 / 512 * (8 + 2 * 128 * 4), rel=2e-3)
    assert _value(rows, "paper/ddp", "bytes_per_step", 512) == pytest.approx(511 * uniq * (8 + 128 * 4), rel=2e-3)
    assert not list(tmp_path.glob("dsa-dist-*")), "the state files' temporary directory was left behind"
    out = tmp_path / "dsa_distributed.png"
    _analysis("dsa_distributed", tmp_path, out)
    _assert_png(out)


# ------------------------------------------------------------------------------ gefen_memory
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gefen_memory_smallest_run(tmp_path, monkeypatch):
    _main("experiments.gefen_memory", ["--optimizers", "AdamW", "Gefen-8bit", "Gefen-8bit-factored", "--repeats", 1,
                                       "--char-lm", "tiny", "--results-dir", tmp_path], monkeypatch)
    everything = _rows(tmp_path / "gefen_memory.csv", "gefen_memory")
    rows = [r for r in everything if r["x_name"] == "model"]
    assert {r["variant"] for r in rows} == {"AdamW", "Gefen-8bit", "Gefen-8bit-factored"}
    assert {r["x_value"] for r in rows} == {"transformer", "mlp"}
    assert {r["metric"] for r in rows} == {"state_bytes_per_param", "first_step_time", "step_time_median",
                                           "step_time_vs_adamw", "threads", "step_time_vs_unfactored"}
    # the bytes by kind after the first step equal the bytes of the convergence run of that seed after
    # all its steps (the first step fixes the blocks), by kind and in all
    _main("experiments.convergence", ["--tiny", "--optimizers", "AdamW", "Gefen-8bit-factored", "--seeds", 1,
                                      "--protocol", "best", "--no-progress", "--wandb", "disabled",
                                      "--results-dir", tmp_path], monkeypatch)
    conv = _rows(tmp_path / "convergence.csv", "convergence")
    label = next(r["x_value"] for r in conv if r["x_name"] == "model")
    for name in ("AdamW", "Gefen-8bit-factored"):
        kinds = {r["x_value"]: r["value"] for r in everything
                 if r["variant"] == f"{label}/{name}" and r["metric"] == "state_bytes_per_param_of_kind"}
        assert kinds == {r["x_value"]: r["value"] for r in conv if r["variant"] == name and r["seed"] == "0"
                         and r["metric"] == "state_bytes_per_param_of_kind"}
        counts = {r["x_value"]: r["value"] for r in everything
                  if r["variant"] == f"{label}/{name}" and r["metric"] == "params_of_kind"}
        every = kinds["shared"] + sum(kinds[k] * counts[k] for k in counts if k != "shared") / sum(counts.values())
        assert every == pytest.approx(_value(conv, name, "state_bytes_per_param"), rel=1e-12)
    for model in ("transformer", "mlp"):
        # AdamW: two fp32 moments per parameter plus one step scalar per tensor
        assert 8.0 < _value(rows, "AdamW", "state_bytes_per_param", model) < 8.001
        assert _value(rows, "Gefen-8bit", "state_bytes_per_param", model) <= 1.05
        assert _value(rows, "AdamW", "step_time_vs_adamw", model) == 1.0
        assert _value(rows, "Gefen-8bit", "step_time_median", model) > 0
        assert _value(rows, "Gefen-8bit", "threads", model) >= 1
    out = tmp_path / "gefen_memory.png"
    _analysis("gefen_memory", tmp_path, out)
    _assert_png(out)


# ------------------------------------------------------------------------------- correctness
def _correctness(tmp_path, monkeypatch, capsys, *flags):
    assert _main("experiments.correctness", ["--quick", *flags, "--results-dir", tmp_path], monkeypatch) == 0
    printed = capsys.readouterr().out
    rows = _rows(tmp_path / "correctness.csv", "correctness")
    variants = {r["variant"] for r in rows}
    for v in variants:
        assert v in printed, f"{v} missing from the printed table"
        assert {r["metric"] for r in rows if r["variant"] == v} == {"max_abs_err", "rel_rms_err"}
    return rows, variants


@pytest.mark.timeout(180)
def test_correctness_quick_torch(tmp_path, monkeypatch, capsys):
    rows, variants = _correctness(tmp_path, monkeypatch, capsys, "--no-triton")
    want = {f"DiskSparseAdam[{b}] vs SparseAdam" for b in ("torch", "numba", "numba,bitwise=False")}
    want |= {"Gefen[reduction] vs AdamW"}
    want |= {f"DiskSparseRiemannianAdam[torch,{m},c={c},float64] vs geoopt-SparseRiemannianAdam"
             for m in ("retr", "exact") for c in ("1", "0.5")}
    assert variants == want
    for r in rows:  # fp32 / fp64 runs against their references from the same start
        assert r["value"] < 1e-6, r
        if r["variant"].startswith(("DiskSparseAdam[torch]", "DiskSparseAdam[numba] ")):
            assert r["value"] == 0, r  # the bitwise paths


@pytest.mark.timeout(180)
def test_correctness_tiny_triton_case(tmp_path, monkeypatch, capsys):
    rows, variants = _correctness(tmp_path, monkeypatch, capsys, "--checks", "DiskSparseAdam/triton")
    assert variants == {"DiskSparseAdam[triton] vs SparseAdam"}
    for r in rows:
        assert r["value"] < 1e-6, r


# -------------------------------------------------------------------------------- reproduce
# The shared harness (and the ahead-of-time compile tool kernel_resources uses): not experiments.
HARNESS = {"common", "data", "models", "registry", "train", "pool", "triton_aot", "peak", "memcg", "op_count",
           "checkout", "tracking", "profiling", "gpu", "child", "disk", "measured_step", "budget"}


def test_reproduce_covers_every_experiment_and_analysis():
    from experiments import reproduce

    gpu_only = {"bench_dsa_gpu", "bench_kernels", "profile_step"}  # prepared GPU checks, not in the run
    scripts = {p.stem for p in (REPO / "experiments").glob("*.py")
               if not p.stem.startswith("_") and p.stem not in HARNESS | {"reproduce"} | gpu_only}
    assert set(reproduce.EXPERIMENTS) == scripts
    # claims*.py write the README's table from every CSV; figure_check.py measures drawn figures; book.py
    # says which page of the results book holds each section
    analyses = {p.stem for p in (REPO / "analysis").glob("*.py")
                if p.stem not in {"common", "__init__", "figure_check", "book"} and not p.stem.startswith(("claims", "_"))}
    drawn = {a for figs in reproduce.EXPERIMENTS.values() for a in figs}
    assert drawn == analyses
    assert set(reproduce.FIGURE_OF) == analyses
    from experiments.gefen_ablation import ABLATIONS

    # every ablation of the table runs: the first as the script's own run, the others as more runs
    assert sorted(run[1] for run in reproduce.MORE_RUNS["gefen_ablation"]) == sorted(list(ABLATIONS)[1:])


def test_reproduce_command_assembly(tmp_path, monkeypatch, capsys):
    import subprocess

    from experiments import reproduce

    calls = []

    def fake_run(cmd, cwd=None, timeout=None):
        calls.append((cmd, cwd, timeout))
        return subprocess.CompletedProcess(cmd, 3 if "analysis" in cmd[1] else 0)

    monkeypatch.setattr(reproduce.subprocess, "run", fake_run)
    res, figs = tmp_path / "res", tmp_path / "figs"
    rc = reproduce.main(["--quick", "--only", "poincare", "hessian_alignment", "--results-dir", str(res),
                         "--figs-dir", str(figs), "--wandb", "disabled", "--timeout", "7"])
    py = sys.executable
    assert [c[0] for c in calls] == [
        [py, str(REPO / "experiments/poincare.py"), "--results-dir", str(res), "--quick", "--wandb", "disabled"],
        [py, str(REPO / "experiments/hessian_alignment.py"), "--results-dir", str(res), "--quick", "--wandb",
         "disabled"],
        [py, str(REPO / "analysis/poincare.py"), "--results-dir", str(res), "--out", str(figs / "poincare.png")],
        [py, str(REPO / "analysis/hessian_alignment.py"), "--results-dir", str(res), "--out",
         str(figs / "hessian_alignment.png")],
    ]
    assert all(c[1] == reproduce.REPO_ROOT and c[2] == 7 for c in calls)
    assert res.is_dir() and figs.is_dir()
    assert rc == 1  # the (fake) analysis steps failed
    out = capsys.readouterr().out
    for step, status in [("experiments/poincare", "ok"), ("experiments/hessian_alignment", "ok"),
                         ("analysis/poincare", "exit 3"), ("analysis/hessian_alignment", "exit 3")]:
        want = [step, *status.split()]
        assert any(line.split()[:len(want)] == want for line in out.splitlines()), (step, out)
    assert "2/4 steps ok" in out


def test_reproduce_check_runs_each_experiment_at_its_check_size_into_results_check(monkeypatch):
    import subprocess

    from experiments import reproduce

    calls = []
    monkeypatch.setattr(reproduce.subprocess, "run",
                        lambda cmd, cwd=None, timeout=None: calls.append((cmd, timeout)) or
                        subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setattr(reproduce, "refuse_committed_outputs", lambda *a, **k: None)
    monkeypatch.setattr(reproduce.Path, "mkdir", lambda *a, **k: None)
    assert reproduce.main(["--check", "--only", "convergence"]) == 0
    runs = [c for c, _ in calls if "experiments" in c[1]]
    check_dir = str(REPO / "results" / "check")
    assert runs and all(c[2:4] == ["--results-dir", check_dir] and c[-1] == "--check" for c in runs)
    assert all("--size" not in c for c in runs)  # a MORE_RUNS size flag would override the check size
    assert all(t == 900 for _, t in calls)
    assert not any("claims.py" in str(c[1]) for c, _ in calls)  # the README's table reads only the full run
    with pytest.raises(SystemExit):
        reproduce.main(["--check", "--quick"])


def test_reproduce_full_run_defaults_and_timeout(tmp_path, monkeypatch, capsys):
    import subprocess

    from experiments import reproduce

    calls = []

    def fake_run(cmd, cwd=None, timeout=None):
        calls.append((cmd, timeout))
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(reproduce.subprocess, "run", fake_run)
    rc = reproduce.main(["--only", "correctness", "--results-dir", str(tmp_path), "--figs-dir", str(tmp_path)])
    assert rc == 1
    assert calls == [([sys.executable, str(REPO / "experiments/correctness.py"), "--results-dir", str(tmp_path)],
                      None),
                     ([sys.executable, str(REPO / "analysis/correctness.py"), "--results-dir", str(tmp_path)], None)]
    assert "timeout" in capsys.readouterr().out


# ---------------------------------------------------------------------------- gefen_ablation
def test_gefen_ablation_groups_give_per_element_v_only_to_the_named_tensors():
    from experiments.gefen_ablation import VARIANTS, per_element_v_groups
    from experiments.harness.models import GPT, GPTConfig
    from experiments.harness.registry import make_optimizer

    model = GPT(GPTConfig(block=16, n_layer=1, n_head=2, n_embd=64))
    for variant, pattern in VARIANTS.items():  # every pattern names some tensor of the model
        if pattern is not None:
            assert per_element_v_groups(model, pattern)[-1]["share_second_moment"] is False, variant
    opt = make_optimizer("Gefen-8bit", per_element_v_groups(model, VARIANTS["attn_qkv"]), 1e-3, 0.1)
    x = torch.randint(0, 50, (4, 16))
    model(x, x).backward()
    opt.step()
    for n, p in model.named_parameters():
        st = opt.state[p]
        if "_proj" in n and "o_proj" not in n:
            assert st["block"] == 1 and st["v"].numel() == p.numel(), n
        elif n == "lm_head.weight":  # a large matrix: the rule shares v
            assert st["block"] > 1 and st["v"].numel() == p.numel() // st["block"], n
    assert all(g["weight_decay"] == 0.1 for g in opt.param_groups)
    published = make_optimizer("Gefen-8bit", model.parameters(), 1e-3, 0.1)
    model.zero_grad()
    model(x, x).backward()
    published.step()  # vectors are no variant: Gefen's rule already keeps their v per element
    assert all(published.state[p]["block"] == 1 for p in model.parameters() if p.dim() == 1)
    groups = per_element_v_groups(model, VARIANTS["attn_qkv"], factored=True)
    assert groups[0]["factor_second_moment"] is True and "factor_second_moment" not in groups[1]


def test_gefen_ablation_patterns_name_the_same_kinds_in_every_architecture():
    """Every architecture's patterns name some tensor of its model, disjoint kinds of matrices, and
    ``vectors`` exactly its 1-D tensors."""
    import re

    from experiments.gefen_ablation import PATTERNS
    from experiments.harness.models import ARCHITECTURES, char_lm_model

    for arch, patterns in PATTERNS.items():
        assert set(patterns) == set(PATTERNS["gpt"]), arch
        model = char_lm_model(ARCHITECTURES[arch][0](block=16, n_layer=2, n_head=2, n_embd=32))
        names = {n: p.dim() for n, p in model.named_parameters()}
        kinds = {v: {n for n in names if re.search(pat, n)} for v, pat in patterns.items() if pat and v != "all"}
        assert all(kinds.values()), (arch, kinds)
        assert kinds["vectors"] == {n for n, d in names.items() if d == 1}, arch
        matrices = [k for v, k in kinds.items() if v != "vectors"]
        assert sum(map(len, matrices)) == len(set().union(*matrices)) == sum(d > 1 for d in names.values()), arch


@pytest.mark.timeout(300)
def test_gefen_ablation_tiny_run_and_figure(tmp_path, monkeypatch):
    _main("experiments.gefen_ablation", ["--tiny", "--variants", "attn_qkv", "factored", "--on-factored",
                                         "--seeds", 2, "--results-dir", tmp_path, "--wandb", "disabled"], monkeypatch)
    rows = _rows(tmp_path / "gefen_ablation.csv", "gefen_ablation")
    base = {r["seed"]: r["value"] for r in rows if r["variant"] == "AdamW" and r["metric"] == "val_loss"}
    assert sorted(base) == ["0", "1"]
    assert {r["variant"] for r in rows} == {"AdamW", "none", "attn_qkv", "factored", "factored+attn_qkv"}
    for v in ("none", "attn_qkv", "factored", "factored+attn_qkv"):
        loss = {r["seed"]: r["value"] for r in rows if r["variant"] == v and r["metric"] == "val_loss"}
        ratio = {r["seed"]: r["value"] for r in rows if r["variant"] == v and r["metric"] == "val_loss_vs_adamw"}
        assert ratio == pytest.approx({s: loss[s] / base[s] for s in base}, rel=1e-12)
        assert _value(rows, v, "val_loss_vs_adamw_mean") == pytest.approx(sum(ratio.values()) / 2, rel=1e-12)
    assert _value(rows, "none", "delta_vs_shared_mean") == 0.0
    # each run's state bytes: AdamW's two fp32 moments (and its step counters); v per element on the
    # attention matrices costs at most 4 B an element of them more
    bpp = {(r["variant"], r["seed"]): r["value"] for r in rows if r["metric"] == "state_bytes_per_param"}
    assert set(bpp) == {(v, s) for v in ("AdamW", "none", "attn_qkv", "factored", "factored+attn_qkv") for s in base}
    import re

    from experiments.gefen_ablation import PATTERNS
    from experiments.harness.models import GPT, GPTConfig
    from experiments.harness.train import CHAR_LM

    t = CHAR_LM["tiny"]
    model = GPT(GPTConfig(block=t["block"], n_layer=t["n_layer"], n_head=t["n_head"], n_embd=t["n_embd"]))
    total = sum(p.numel() for p in model.parameters())
    qkv = sum(p.numel() for n, p in model.named_parameters() if re.search(PATTERNS["gpt"]["attn_qkv"], n))
    for s in base:
        assert bpp[("AdamW", s)] == pytest.approx(8 + 4 * len(list(model.parameters())) / total, rel=1e-12)
        assert 0 < bpp[("attn_qkv", s)] - bpp[("none", s)] <= 4 * qkv / total  # less where a block was 1 already
    out = tmp_path / "gefen_ablation.png"
    _analysis("gefen_ablation", tmp_path, out)
    _assert_png(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gefen_ablation_two_configurations_two_jobs_equal_one(tmp_path, monkeypatch):
    """A second configuration (the tiny model on the docstring corpus) writes ``<label>/<variant>`` rows
    and its own AdamW baseline; runs in two worker processes give the rows of one process."""
    from experiments.harness.train import CHAR_LM, model_label_of

    monkeypatch.setitem(CHAR_LM, "tiny-docstrings", dict(CHAR_LM["tiny"], corpus="docstrings"))
    argv = ["--tiny", "--sizes", "tiny", "tiny-docstrings", "--variants", "factored", "--seeds", 1,
            "--wandb", "disabled"]
    _main("experiments.gefen_ablation", argv + ["--jobs", 1, "--results-dir", tmp_path / "one"], monkeypatch)
    _main("experiments.gefen_ablation", argv + ["--jobs", 2, "--results-dir", tmp_path / "two"], monkeypatch)
    one, two = (_rows(tmp_path / d / "gefen_ablation.csv", "gefen_ablation") for d in ("one", "two"))
    assert sorted((r["variant"], r["metric"], r["value"]) for r in one) == \
        sorted((r["variant"], r["metric"], r["value"]) for r in two)
    tiny = {r["variant"]: r["value"] for r in one if r["metric"] == "val_loss"}
    from experiments.harness.models import GPT, GPTConfig

    t = CHAR_LM["tiny"]
    label = model_label_of(sum(p.numel() for p in GPT(GPTConfig(block=t["block"], n_layer=t["n_layer"],
                                                                 n_head=t["n_head"], n_embd=t["n_embd"])).parameters()),
                           "docstrings")
    assert set(tiny) == {"AdamW", "none", "factored", f"{label}/AdamW", f"{label}/none", f"{label}/factored"}
    assert tiny["AdamW"] != tiny[f"{label}/AdamW"]  # another corpus: another loss


def test_gefen_ablation_fp32_m_keeps_the_first_moment_in_fp32_on_every_tensor():
    """``factored+fp32_m``: every tensor factored (matrices) and its first moment a plain fp32 tensor,
    after one step (1 - beta1) times the gradient (the first moment starts at zero)."""
    from experiments.gefen_ablation import variant_groups
    from experiments.harness.models import ARCHITECTURES, char_lm_model
    from experiments.harness.registry import make_optimizer

    torch.manual_seed(0)
    model = char_lm_model(ARCHITECTURES["encoder"][0](block=16, n_layer=1, n_head=2, n_embd=32))
    opt = make_optimizer("Gefen-8bit", variant_groups(model, "factored+fp32_m", "encoder"), 1e-3, 0.1)
    x = torch.randint(0, 50, (2, 16))
    model(x, x).backward()
    grads = {p: p.grad.clone() for p in model.parameters()}
    opt.step()
    for n, p in model.named_parameters():
        st = opt.state[p]
        assert st["m"].dtype == torch.float32 and st["m"].numel() == p.numel(), n
        torch.testing.assert_close(st["m"].view_as(p), 0.1 * grads[p], rtol=1e-6, atol=0, msg=n)
    qkv = opt.state[model.layers[0].self_attn.in_proj_weight]  # (96, 32): factored, three square tiles
    assert qkv["v"].numel() == 96 and qkv["w"].numel() == 3 * 32


@pytest.mark.timeout(300)
def test_gefen_ablation_arch_runs_each_architecture_at_its_lr(tmp_path, monkeypatch):
    """``--experiment gefen_ablation_arch --tiny``: the tiny size in the encoder and the Llama-style
    architecture, each at ``DROPIN_LR`` of its full size, only variants on top of the factor (and the
    published Gefen as the base), its own results file and analysis."""
    from experiments.gefen_ablation import ABLATIONS, DROPIN_LR

    _main("experiments.gefen_ablation", ["--experiment", "gefen_ablation_arch", "--tiny", "--peers", "--seeds", 1,
                                         "--variants", "attn_qkv", "factored+fp32_m", "--results-dir", tmp_path,
                                         "--wandb", "disabled"], monkeypatch)
    rows = _rows(tmp_path / "gefen_ablation_arch.csv", "gefen_ablation_arch")
    variants = {r["variant"] for r in rows}
    (label,) = {v.split("/")[0] for v in variants if "/" in v}
    assert label.startswith("char-llama-")
    assert variants == {p + v for p in ("", label + "/") for v in ("AdamW", "none", "factored+attn_qkv", "factored+fp32_m")}
    config = json.loads((tmp_path / "gefen_ablation_arch.config.json").read_text())["config"]
    assert config["arch"] == "encoder" and config["lr"] == DROPIN_LR[ABLATIONS["gefen_ablation_arch"].sizes[0]]
    assert config["extra"][label]["arch"] == "llama" and config["extra"][label]["lr"] == DROPIN_LR["llama"]


@pytest.mark.parametrize("size, experiment, first", [("full", "convergence", True), ("large", "convergence", False),
                                                    ("docstrings", "convergence", False),
                                                    ("encoder", "convergence_encoder", True),
                                                    ("llama", "convergence_llama", True)])
def test_dropin_lr_is_adamw_best_in_the_committed_convergence_run(size, experiment, first):
    """The ablations' drop-in lr of a configuration is AdamW's best lr in its committed convergence run
    (first configuration of a file unprefixed, the others under their model label)."""
    from experiments.gefen_ablation import DROPIN_LR
    from experiments.harness.train import CHAR_LM, char_lm_label

    variant = "AdamW" if first else f"{char_lm_label(CHAR_LM[size])}/AdamW"
    best = {r["value"] for r in read_results(experiment) if r["metric"] == "best_lr" and r["variant"] == variant}
    assert best == {DROPIN_LR[size]}, (size, best)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("experiment, changes, words", [
    ("gefen_ablation_long", {"factored+sr_m"}, ["codes rounded stochastically"]),
    ("gefen_ablation_long_best", {"factored+fp32_m", "factored+refresh", "factored+layout"},
     ["the first moment in fp32", "the codebook learned again every 100 steps",
      "row-group scales and one column factor per matrix"]),
    ("gefen_ablation_layout", {"factored+layout", "factored+scale_rows"},
     ["row-group scales and one column factor per matrix", "one first-moment scale per group of rows"]),
    ("gefen_ablation_column", {"factored+whole_w"}, ["one column factor per matrix"]),
    ("gefen_ablation_vectors", {"factored+vec_v", "factored+rows_v"},
     ["the vectors' v shared", "v over whole rows where the rule finds no block"]),
    ("gefen_ablation_4bit", {"factored+scale_rows", "factored+scale_rows512", "factored+layout", "factored+layout512"},
     ["4-bit codes", "group of rows of at most 512 elements", "options with scale groups of at most 512"]),
    ("gefen_ablation_refresh", {"factored+refresh", "factored+layout512", "factored+layout512_refresh"},
     ["4-bit codes", "the codebook learned again every 100 steps", "scale groups of at most 512 elements and the codebook"]),
    ("gefen_ablation_factor16", {"factored+w16", "factored+layout512", "factored+layout512_tiles",
                                 "factored+layout512_w16"},
     ["4-bit codes", "the column factors in bf16", "a bf16 column factor per tile"]),
    ("gefen_ablation_vectors4", {"factored+vec_v", "factored+rows_v"},
     ["4-bit codes", "the vectors' v shared", "v over whole rows where the rule finds no block"]),
    ("gefen_ablation_scales4", {"factored+layout512", "factored+scale_rows256", "factored+layout256",
                                "factored+layout256_w16"},
     ["4-bit codes", "group of rows of at most 256 elements", "the 256-element layout, its column factor in bf16"]),
    ("gefen_ablation_leave_out4", {"factored+layout512", *(f"factored+layout512_no_{o}"
                                                          for o in ("vec_v", "rows_v", "scale_rows", "whole_w"))},
     ["4-bit codes", "the 512-element layout without the vectors' shared v", "without whole-row v",
      "without row-group scales", "without one column factor a matrix"])])
def test_gefen_ablation_on_the_factor_runs_the_factor_and_its_changes_only(tmp_path, monkeypatch, experiment,
                                                                          changes, words):
    """``--experiment gefen_ablation_long`` / ``gefen_ablation_layout`` ``--tiny``: the tiny size in the
    encoder at the experiments' lr, the factor and the experiment's changes on top of it (the first
    moment's codes rounded stochastically; the four layout options together, and row-group scales), its own
    results file and analysis, whose finding names each."""
    from experiments.gefen_ablation import ABLATIONS

    _main("experiments.gefen_ablation", ["--experiment", experiment, "--tiny", "--peers", "--seeds", 1,
                                         "--results-dir", tmp_path, "--wandb", "disabled"], monkeypatch)
    rows = _rows(tmp_path / f"{experiment}.csv", experiment)
    assert {r["variant"] for r in rows} == {"AdamW", "factored", *changes}
    config = json.loads((tmp_path / f"{experiment}.config.json").read_text())["config"]
    lr = 8e-3 if experiment.endswith("_best") else 4e-3  # AdamW's best at 3,000 steps, else at 1,000
    assert config["arch"] == "encoder" and config["lr"] == ABLATIONS[experiment].lr == lr


@pytest.mark.timeout(300)
def test_gefen_ablation_refresh_models_runs_each_architecture_once_at_its_dropin_lr(tmp_path, monkeypatch):
    """``--experiment gefen_ablation_refresh_models --tiny``: the tiny size once per architecture (the
    GPT's three configurations are one there), each at ``DROPIN_LR`` of its first full size, 4-bit
    codes, the factor without and with the codebook refresh; its analysis names the change."""
    from experiments.gefen_ablation import DROPIN_LR

    _main("experiments.gefen_ablation", ["--experiment", "gefen_ablation_refresh_models", "--tiny", "--seeds", 1,
                                         "--results-dir", tmp_path, "--wandb", "disabled"], monkeypatch)
    rows = _rows(tmp_path / "gefen_ablation_refresh_models.csv", "gefen_ablation_refresh_models")
    config = json.loads((tmp_path / "gefen_ablation_refresh_models.config.json").read_text())["config"]
    labels = list(config["extra"])
    assert [label.split("-")[1] for label in labels] == ["encoder", "llama"]
    assert {r["variant"] for r in rows} == {p + v for p in ("", *(f"{m}/" for m in labels))
                                            for v in ("AdamW", "factored", "factored+refresh")}
    assert config["bits"] == 4 and config["arch"] == "gpt" and config["lr"] == DROPIN_LR["full"]
    assert [config["extra"][m]["lr"] for m in labels] == [DROPIN_LR["encoder"], DROPIN_LR["llama"]]


@pytest.mark.timeout(300)
def test_gefen_ablation_seeds_trains_the_registry_peer_beside_the_factor(tmp_path, monkeypatch):
    """``--experiment gefen_ablation_seeds --tiny``: the tiny size in the encoder and the GPT, each at
    its drop-in lr, AdamW, the factored 8-bit and the registry's Gefen-4bit-factored as a peer on every
    seed; the peer is the registry's optimizer (its loss that of a run of that name), and the analysis
    names it."""
    from experiments.gefen_ablation import DROPIN_LR, final_loss
    from experiments.harness.train import CHAR_LM

    _main("experiments.gefen_ablation", ["--experiment", "gefen_ablation_seeds", "--tiny", "--seeds", 2, "--peers",
                                         "Gefen-4bit-factored", "--results-dir", tmp_path, "--wandb", "disabled"],
          monkeypatch)
    rows = _rows(tmp_path / "gefen_ablation_seeds.csv", "gefen_ablation_seeds")
    config = json.loads((tmp_path / "gefen_ablation_seeds.config.json").read_text())["config"]
    (label,) = config["extra"]
    assert {r["variant"] for r in rows} == {p + v for p in ("", f"{label}/")
                                            for v in ("AdamW", "factored", "Gefen-4bit-factored")}
    assert config["arch"] == "encoder" and config["lr"] == DROPIN_LR["encoder"] and config["seeds"] == [0, 1]
    assert config["extra"][label]["arch"] == "gpt" and config["extra"][label]["lr"] == DROPIN_LR["full"]
    peer, factored = ({int(r["seed"]): r["value"] for r in rows if r["variant"] == v and r["metric"] == "val_loss"}
                      for v in ("Gefen-4bit-factored", "factored"))
    size = dict(CHAR_LM["tiny"], arch="encoder")
    assert peer[1] == final_loss(size, "Gefen-4bit-factored", 1, DROPIN_LR["encoder"]).loss != factored[1]


@pytest.mark.timeout(300)
def test_gefen_ablation_seeds_fp32m_runs_the_factor_with_and_without_its_codes(tmp_path, monkeypatch):
    """``--experiment gefen_ablation_seeds_fp32m --tiny``: gefen_ablation_seeds' configurations without
    peers, the factored 8-bit and its first moment in fp32 (no codes: no codebook in its state)."""
    from experiments.gefen_ablation import DROPIN_LR

    experiment = "gefen_ablation_seeds_fp32m"
    _main("experiments.gefen_ablation", ["--experiment", experiment, "--tiny", "--seeds", 1, "--results-dir", tmp_path,
                                         "--wandb", "disabled"], monkeypatch)
    rows = _rows(tmp_path / f"{experiment}.csv", experiment)
    config = json.loads((tmp_path / f"{experiment}.config.json").read_text())["config"]
    (label,) = config["extra"]
    assert {r["variant"] for r in rows} == {p + v for p in ("", f"{label}/")
                                            for v in ("AdamW", "factored", "factored+fp32_m")}
    assert (config["lr"], config["extra"][label]["lr"]) == (DROPIN_LR["encoder"], DROPIN_LR["full"])


@pytest.mark.skipif(not (GEFEN_X_DIR / "gefen").is_dir(), reason="gefen-x is not installed in third_party/gefen_x")
def test_gefen_ablation_peer_trains_gefen_x():
    from experiments.gefen_ablation import final_loss
    from experiments.harness.train import CHAR_LM

    size = dict(CHAR_LM["tiny"], steps=3)
    peer, adamw = final_loss(size, "gefen-x", 0, 1e-3).loss, final_loss(size, None, 0, 1e-3).loss
    assert math.isfinite(peer) and peer != adamw


# ------------------------------------------------------------------------------- codebook_dp
@pytest.mark.timeout(180)
def test_codebook_dp_tiny_run(tmp_path, monkeypatch):
    _main("experiments.codebook_dp", ["--quick", "--steps", 3, "--bins", 256, "--repeats", 1, "--no-cold-start",
                                      "--results-dir", tmp_path], monkeypatch)
    rows = _rows(tmp_path / "codebook_dp.csv", "codebook_dp")
    for impl in ("ours-numba", "ours-numpy", "upstream"):
        assert _value(rows, f"{impl}/K16", "dp_time", 256.0) > 0
    # ours and upstream solve the same DP: the same optimum up to upstream's float32 levels
    assert _value(rows, "ours-numba/K16", "cost_rel_diff_vs_upstream", 256.0) < 1e-4
    for bits in (8, 4):
        for blocking in ("absmax256", "gefen"):
            learned = _value(rows, f"learned/{bits}bit/{blocking}", "rel_mse")
            assert 0 < learned <= _value(rows, f"linear/{bits}bit/{blocking}", "rel_mse")
    out = tmp_path / "codebook.png"
    _analysis("codebook", tmp_path, out)
    _assert_png(out)


# ---------------------------------------------------------------------------------- harness
def test_results_replace_the_csv_and_write_the_run_config(tmp_path, monkeypatch):
    import argparse
    import json

    from experiments.harness.common import Results, add_common_args

    from experiments.harness.common import REPO_ROOT

    monkeypatch.setattr(sys, "argv", [str(REPO_ROOT / "experiments/x.py"), "--seed", "3", "--results-dir",
                                      str(REPO_ROOT / "results/quick")])
    args = add_common_args(argparse.ArgumentParser()).parse_args(["--results-dir", str(tmp_path), "--seed", "3",
                                                                  "--wandb", "disabled"])
    for run in range(2):
        with Results("x", args, config={"size": run, "path": tmp_path}) as res:
            res.add("AdamW", "val_loss", "nats", 2.0 + run, x_name="step", x_value=10)
    rows = _rows(tmp_path / "x.csv", "x")
    assert [(r["variant"], r["value"], r["seed"]) for r in rows] == [("AdamW", 3.0, "3")]  # replaced
    meta = json.loads((tmp_path / "x.config.json").read_text())
    assert set(meta) == {"config", "git_commit", "device", "torch_version", "command", "wall_seconds", "timestamp",
                         "versions", "wandb"}
    assert meta["config"] == {"size": 1, "path": str(tmp_path)}
    # a command that reruns the experiment from the repository root, whatever the absolute paths were
    assert meta["command"] == "python experiments/x.py --seed 3 --results-dir results/quick" and meta["wall_seconds"] >= 0
    assert meta["timestamp"] == rows[0]["timestamp"] and meta["git_commit"] == rows[0]["git_commit"]


def test_quick_runs_write_under_quick(monkeypatch):
    import argparse

    from experiments.harness import common

    parse = common.add_common_args(argparse.ArgumentParser()).parse_args
    assert common.Results("x", parse(["--quick", "--wandb", "disabled"])).results_dir == common.RESULTS_DIR / "quick"
    assert common.Results("x", parse(["--wandb", "disabled"])).results_dir == common.RESULTS_DIR


def test_registry_names_are_the_canonical_ones():
    from experiments.harness.registry import CPU_PEERS, DENSE, GPU_PEERS, OPTIMIZERS

    assert DENSE == ["AdamW", "Adam-mini", "torchao-AdamW8bit", "torchao-AdamW4bit", "gefen-upstream", "gefen-x",
                     "Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored", "Gefen-4bit-factored", "Gefen-8bit-compact",
                     "Gefen-4bit-compact"]
    assert GPU_PEERS == ["flashoptim-AdamW", "bnb-AdamW8bit", "torchao-AdamW8bit", "gefen-x"]
    assert CPU_PEERS == ["deepspeed-CPUAdam", "bnb-AdamW8bit"]
    assert set(OPTIMIZERS) == set(DENSE) | set(GPU_PEERS) | set(CPU_PEERS) | {"SparseAdam", "DiskSparseAdam",
                                                             "DiskSparseRiemannianAdam", "geoopt-SparseRiemannianAdam"}


def test_experiments_do_not_import_each_other():
    import ast

    scripts = {p.stem for p in (REPO / "experiments").glob("*.py")} - HARNESS - {"__init__"}
    for path in (REPO / "experiments").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for n in names:
                parts = n.split(".")
                if parts[0] == "experiments" and len(parts) > 1 and parts[1] in scripts - {path.stem}:
                    assert parts[1].startswith("_") and path.stem == "hessian_alignment", (path.name, n)


def test_interleaved_timer_runs_each_candidate_once_per_repeat():
    from experiments.harness.train import interleaved, median

    calls = []
    fns = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    times = interleaved(fns, 4, shuffle=True, before=lambda n: calls.append("before " + n))
    assert len(calls) == 24 and all(calls[i] == "before " + calls[i + 1] for i in range(0, 24, 2))
    rounds = [calls[1::2][3 * k:3 * k + 3] for k in range(4)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds) and len({tuple(r) for r in rounds}) > 1
    assert all(len(t["wall"]) == len(t["cpu"]) == 4 for t in times.values())
    assert set(median(times)) == {"a", "b", "c"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dsa_seed_benchmark_smallest_run(tmp_path):
    """The seed's benchmark on a small table: every optimizer reports every epoch, the disk optimizer
    keeps its state on disk and follows geoopt's loss, and the analysis draws the figure."""
    from analysis.dsa_seed_benchmark import REPORT
    from analysis.common import main as analysis_main
    from experiments import dsa_seed_benchmark
    from experiments.harness.common import read_results

    assert dsa_seed_benchmark.main(["--rows", "3000", "--epochs", "2", "--wandb", "disabled",
                                    "--results-dir", str(tmp_path)]) == 0
    rows = read_results(tmp_path / "dsa_seed_benchmark.csv")
    by = {(r["variant"], r["metric"], r["x_value"]): r["value"] for r in rows}
    for name in dsa_seed_benchmark.OPTIMIZERS:
        for epoch in (1, 2):
            assert by[(name, "throughput", epoch)] > 0 and by[(name, "loss", epoch)] > 0
    assert by[("DiskSparseRiemannianAdam", "bytes_on_disk", 2)] > 0
    ours, geo = (by[(n, "loss", 2)] for n in ("DiskSparseRiemannianAdam", "geoopt-SparseRiemannianAdam"))
    assert abs(ours - geo) <= 1e-5 * geo
    analysis_main(REPORT, ["--results-dir", str(tmp_path), "--out", str(tmp_path / "f.png")])
    assert (tmp_path / "f.png").exists()


@pytest.mark.timeout(300)
def test_dsa_billions_smallest_run(tmp_path):
    """The out-of-core table experiment on a small table: both formats and the scaling point report
    rates, disk and write figures, the free-space check refuses what cannot fit, and nothing stays."""
    import tempfile

    from analysis.common import main as analysis_main
    from analysis.dsa_billions import REPORT
    from experiments import dsa_billions

    before = set(os.listdir(tempfile.gettempdir()))
    assert dsa_billions.main(["--quick", "--rows", "20000", "--scale-rows", "5000", "--steps", "12",
                              "--skip-sparse-adam", "--wandb", "disabled", "--results-dir", str(tmp_path)]) == 0
    rows = read_results(tmp_path / "dsa_billions.csv")
    by = {(r["variant"], r["metric"]): r["value"] for r in rows}
    for fmt in ("exact", "compact"):
        assert by[(f"DiskSparseAdam/{fmt}", "steady_samples_per_s")] > 0
        assert by[(f"DiskSparseAdam/{fmt}", "bytes_on_disk")] > 20000 * 64 * 4
    assert by[("DiskSparseAdam/compact/scaling", "steady_rows_per_s")] > 0
    assert not {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("dsa-billions-")}
    analysis_main(REPORT, ["--results-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="GiB free"):
        dsa_billions.main(["--rows", str(10**13), "--skip-sparse-adam", "--wandb", "disabled",
                           "--results-dir", str(tmp_path)])


# ------------------------------------------------- architectures not developed on, drop-in protocol
@pytest.mark.parametrize("arch", ["encoder", "llama"])
def test_new_architectures_are_causal_lms_that_adamw_trains(arch):
    """A tiny model of each: a finite fp32 loss near log(vocab) at initialisation, logits at a position
    independent of later tokens, the loss lower after a few AdamW steps on one batch; the encoder keeps
    torch's fused q/k/v tensor and zero positions, the Llama-style model has no biases."""
    from experiments.harness.data import VOCAB_SIZE
    from experiments.harness.models import ARCHITECTURES, char_lm_model

    config_cls, model_cls = ARCHITECTURES[arch]
    model = char_lm_model(config_cls(block=16, n_layer=1, n_head=2, n_embd=32))
    assert type(model) is model_cls
    names = dict(model.named_parameters())
    if arch == "encoder":
        assert "layers.0.self_attn.in_proj_weight" in names and not names["pos"].any()
    else:
        assert not any(n.endswith("bias") for n in names)
    x = torch.randint(0, VOCAB_SIZE, (4, 16))
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % VOCAB_SIZE
    a, b = model(x), model(changed)
    assert torch.equal(a[:, :9], b[:, :9]) and not torch.equal(a[:, 9:], b[:, 9:])
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = model(x, y)
        assert loss.dtype == torch.float32 and math.isfinite(loss.item())
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(VOCAB_SIZE)) < 0.5 and losses[-1] < losses[0] - 0.1, losses
    assert model.to(torch.bfloat16)(x, y).dtype == torch.float32  # the loss in fp32 whatever the weights'


def test_char_lm_labels_name_the_architecture():
    """Sizes of one shape and corpus but another architecture get distinct labels."""
    from experiments.harness.models import ARCHITECTURES, char_lm_model
    from experiments.harness.train import CHAR_LM, model_label_of

    labels = {}
    for name in ("docstrings", "encoder", "llama"):
        size = CHAR_LM[name]
        config_cls, _ = ARCHITECTURES[size.get("arch", "gpt")]
        cfg = config_cls(block=size["block"], n_layer=size["n_layer"], n_head=size["n_head"], n_embd=size["n_embd"])
        labels[name] = model_label_of(sum(p.numel() for p in char_lm_model(cfg).parameters()),
                                      size.get("corpus", "docs+code"), size.get("arch", "gpt"))
    assert labels == {"docstrings": "char-gpt-429k-docstrings", "encoder": "char-encoder-430k",
                      "llama": "char-llama-427k"}


@pytest.mark.timeout(120)
def test_dropin_protocol_tiny_quick(tmp_path, monkeypatch):
    """--protocol dropin on the tiny encoder: AdamW's sweep, then every optimizer (one of LR_SCALED
    also at its multiple) at AdamW's best lr on every seed, as dropin/<name> rows whose ratios are
    paired by seed; the analysis judges the targets from them. (gefen-x, LR_SCALED's optimizer, takes
    seconds to set up: a Gefen variant stands in for it here.)"""
    from analysis import convergence as analysis
    from analysis.common import main as analysis_main, read_section
    from experiments import convergence as conv
    from experiments.harness.train import CHAR_LM, char_lm_label

    monkeypatch.setitem(CHAR_LM, "tiny-encoder", dict(CHAR_LM["tiny"], arch="encoder"))
    monkeypatch.setattr(conv, "LR_SCALED", {"Gefen-4bit-factored": 0.5})
    names = ["AdamW", "Gefen-8bit-factored", "Gefen-4bit-factored"]
    _main("experiments.convergence", ["--tiny", "--quick", "--size", "tiny-encoder", "--protocol", "dropin",
                                      "--optimizers", *names, "--lrs", 3e-3, 1e-2, "--seeds", 2, "--no-progress",
                                      "--wandb", "disabled", "--results-dir", tmp_path], monkeypatch)
    rows = _rows(tmp_path / "convergence.csv", "convergence")
    want = {"dropin/" + n for n in conv.dropin_names(names)}
    assert {r["variant"] for r in rows if r["x_name"] != "model"} == want
    sweep = {r["x_value"]: r["value"] for r in rows if r["metric"] == "lr_sweep_val_loss"}
    assert {r["variant"] for r in rows if r["metric"] == "lr_sweep_val_loss"} == {"dropin/AdamW"}
    best = min(sweep, key=sweep.get)
    assert _value(rows, "dropin/AdamW", "best_lr") == best
    for n in names[1:]:
        assert _value(rows, "dropin/" + n, "lr") == best
    assert _value(rows, "dropin/Gefen-4bit-factored@0.5", "lr") == pytest.approx(0.5 * best)
    final = {(r["variant"], r["seed"]): r["value"] for r in rows if r["metric"] == "final_val_loss"}
    for v in want:
        ratio = {r["seed"]: r["value"] for r in rows if r["variant"] == v and r["metric"] == "val_loss_vs_adamw"}
        assert ratio == pytest.approx({s: final[(v, s)] / final[("dropin/AdamW", s)] for s in ("0", "1")}, rel=1e-12)
        assert _value(rows, v, "val_loss_vs_adamw_min") == min(ratio.values())
        assert _value(rows, v, "val_loss_vs_adamw_max") == max(ratio.values())
    label = char_lm_label(CHAR_LM["tiny-encoder"])
    assert label.startswith("char-encoder-") and {r["x_value"] for r in rows if r["x_name"] == "model"} == {label}
    analysis_main(analysis.REPORT, ["--results-dir", str(tmp_path), "--out", str(tmp_path / "f.png")])
    section = read_section(tmp_path / "README.md", "convergence")
    assert f"**{label}, drop-in**" in section and f"| {label} | drop-in |" in section


def test_an_architecture_experiment_has_its_own_defaults_and_file(tmp_path, monkeypatch):
    """--experiment convergence_<arch>: that architecture as the main configuration, no extra
    configurations, UNTUNED's optimizers, both protocols (each overridable); the rows go to
    convergence_<arch>.csv, whose analysis script reads them."""
    from analysis import convergence_encoder as analysis
    from analysis.common import main as analysis_main, read_section
    from experiments import convergence as conv

    args = conv.parse_args(["--experiment", "convergence_llama"])
    assert (args.size, args.extra, args.optimizers, args.protocol) == ("llama", ["none"], conv.UNTUNED, "both")
    assert "torchao-AdamW8bit" in conv.UNTUNED and "gefen-x" in conv.UNTUNED
    args = conv.parse_args(["--experiment", "convergence_encoder", "--protocol", "best", "--optimizers", "AdamW"])
    assert (args.size, args.protocol, args.optimizers) == ("encoder", "best", ["AdamW"])
    assert conv.parse_args([]).protocol == "both" and conv.parse_args([]).optimizers == conv.DENSE
    assert conv.parse_args(["--experiment", "convergence_bf16"]).protocol == "best"
    assert all("gefen-x" in names and "torchao-AdamW8bit" in names  # the peers in every configuration
               for names in (conv.DENSE, conv.LARGE, conv.EXTRA_OPTIMIZERS["docstrings"]))
    args = conv.parse_args(["--experiment", "convergence_long"])
    assert (args.size, args.steps, args.seeds, args.protocol) == ("encoder", 3000, 3, "dropin")
    assert args.lrs == [2e-3, 4e-3, 8e-3] and conv.parse_args(["--experiment", "convergence_encoder"]).lrs is None
    args = conv.parse_args(["--experiment", "convergence_long_lr"])  # the same at the 1,000-step lr only
    assert (args.size, args.steps, args.seeds, args.protocol, args.lrs) == ("encoder", 3000, 5, "dropin", [4e-3])
    args = conv.parse_args(["--experiment", "convergence_long", "--quick"])
    assert (args.size, args.steps, args.seeds, args.lrs) == (None, None, None, None)  # the quick size's own

    assert conv.parse_args(["--experiment", "convergence_encoder", "--quick"]).size is None  # quick dims
    _main("experiments.convergence", ["--experiment", "convergence_encoder", "--tiny",
                                      "--optimizers", "AdamW", "Gefen-8bit-factored", "--lrs", 3e-3, "--seeds", 2,
                                      "--no-progress", "--wandb", "disabled", "--results-dir", tmp_path], monkeypatch)
    assert not (tmp_path / "convergence.csv").exists()
    rows = _rows(tmp_path / "convergence_encoder.csv", "convergence_encoder")
    label = next(r["x_value"] for r in rows if r["x_name"] == "model")
    assert label.startswith("char-encoder-")  # the tiny dimensions, in the encoder architecture
    assert {r["variant"] for r in rows if r["metric"] == "final_val_loss"} == {
        "AdamW", "Gefen-8bit-factored", "dropin/AdamW", "dropin/Gefen-8bit-factored"}
    analysis_main(analysis.REPORT, ["--results-dir", str(tmp_path), "--out", str(tmp_path / "f.png")])
    assert "drop-in" in read_section(tmp_path / "README.md", "convergence_encoder")
