"""The README's claims table and results/README.md's "Claims in detail" are what analysis/claims.py makes of
the committed results."""

import csv
import re

import pytest

from analysis import claims, claims_common, claims_dsa, claims_gefen
from analysis.common import ResultsError, read_section
from experiments.harness.common import FIELDS, REPO_ROOT, RESULTS_DIR


def _reads():
    """(row, experiment) for every CSV each row reads (``Results.read`` notes them)."""
    results, out = claims_common.Results(), []
    for f in claims.ROWS:
        results.read = []
        f(results)
        out += [pytest.param(f, e, id=f"{f.__name__}-{e}") for e in sorted(results.read)]
    return out


def _write_csv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        w.writeheader()
        w.writerows(rows)


def _row(**kw):
    base = dict(experiment="x", variant="v", metric="m", unit="", x_name="", x_value="", value=0, seed=0,
                device="cpu", torch_version="2", git_commit="abc", timestamp="2026-01-01T00:00:00")
    return {**base, **kw}


def test_readme_block_is_generated_from_the_committed_results():
    doc = (REPO_ROOT / "README.md").read_text()
    m = re.search(re.escape(claims.BEGIN) + r"\n(.*?)\n" + re.escape(claims.END), doc, re.S)
    assert m, "README.md has no claims block"
    assert m.group(1) == claims.block(), "README's claims block differs from the results: run python analysis/claims.py"


def test_results_detail_is_generated_from_the_committed_results():
    text = read_section(RESULTS_DIR / "claims.md", claims.DETAIL)
    assert text is not None, f"results/claims.md has no {claims.DETAIL} section"
    assert text == claims.detail(), "results/claims.md's claims detail differs from the results: run python analysis/claims.py"


def test_results_index_is_generated_from_the_committed_results():
    assert (RESULTS_DIR / "README.md").read_text() == claims.index(), \
        "results/README.md (the book's index) differs from the results: run python analysis/claims.py"


def test_detail_has_one_entry_per_row_with_its_headline_and_runs():
    text = claims.detail()
    results = claims_common.Results()
    for f in claims.ROWS:
        results.read = []
        row = f(results)
        entry = next((" ".join(p.split()) for p in text.split("\n\n") if p.startswith(f"**{row.claim}**")), None)
        assert entry is not None, row.claim  # one paragraph, its lines joined (the page wraps them)
        assert " ".join(f"(*{row.verdict}*): {row.headline}.".split()) in entry and " ".join(row.detail.split()) in entry
        for e in results.read:  # every CSV the row read: its run's commit and command, a link to its section
            config = claims_common.Results().run(e)
            assert f"commit `{config['git_commit']}`" in entry and f"`{config['command']}`" in entry, (row.claim, e)
        assert ".md#" in entry or "](gpu/" in entry, row.claim


def test_table_reads_one_way_and_stays_short():
    text = claims.block()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| claim")]
    assert 20 <= len(rows) <= 24
    for line in rows:
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        assert len(cells) == 5, line
        assert len(cells[2]) < 160, cells[2]
        assert not re.search(r"×\s*(less|more)|'s (step )?time", cells[2]), f"a ratio that is not a speed: {cells[2]}"


@pytest.mark.parametrize("row, experiment", _reads())
def test_row_names_the_csv_that_lacks_its_metric(tmp_path, row, experiment):
    """Every results file but ``experiment``'s CSV is the committed one; that CSV holds no metric the row needs."""
    for path in [p for p in list(RESULTS_DIR.glob("*")) + list(RESULTS_DIR.glob("gpu/*")) if p.is_file()]:
        dest = tmp_path / path.relative_to(RESULTS_DIR)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.symlink_to(path)
    target = tmp_path / f"{experiment}.csv"
    target.unlink()
    _write_csv(target, [_row(metric="unrelated")])
    with pytest.raises(ResultsError, match=re.escape(f"{experiment}.csv")):
        row(claims_common.Results(tmp_path))


def _fault_rows(failures, refused=7):
    counts = dict(failures=failures, trials=120, refused_dirty=refused, accepted_clean=120 - refused,
                  bitwise_continuations=120 - failures)
    rows = [_row(variant="DiskSparseAdam", metric=m, x_name="phase", x_value="all", value=v) for m, v in counts.items()]
    return rows + [_row(variant=f"DiskSparseAdam/{s}", metric="trials", x_name="phase", x_value=p, value=30)
                   for s in ("SIGKILL", "SIGINT") for p in ("create", "step")]


@pytest.mark.parametrize("failures", [0, 3])
def test_headline_and_verdict_follow_the_data(tmp_path, failures):
    _write_csv(tmp_path / "dsa_fault_injection.csv", _fault_rows(failures))
    row = claims_dsa.dsa_fault_injection(claims_common.Results(tmp_path))
    assert row.headline == f"{failures} failures in 120 SIGKILL and SIGINT trials"
    assert row.verdict == ("holds" if failures == 0 else "not met")


@pytest.mark.parametrize("refused", [7, 41])
def test_detail_is_computed_from_the_data_not_copied(tmp_path, refused):
    """A synthetic CSV's figures, and only they, appear in the row's detail paragraph and its entry."""
    _write_csv(tmp_path / "dsa_fault_injection.csv", _fault_rows(3, refused))
    results = claims_common.Results(tmp_path)
    row = claims_dsa.dsa_fault_injection(results)
    assert f"refused as dirty ({refused}) or accepted as clean ({120 - refused})" in row.detail
    assert "bitwise like SparseAdam (117 of 120)" in row.detail and "in the phases create and step" in row.detail
    committed = claims_dsa.dsa_fault_injection(claims_common.Results())
    assert committed.detail != row.detail
    assert "commit `abc`" in claims.run_text(results, "dsa_fault_injection", {})


def test_check_fails_on_a_hand_edit_and_passes_after_writing(tmp_path):
    readme, results_readme = tmp_path / "top.md", tmp_path / "claims.md"
    readme.write_text(f"# x\n\n{claims.BEGIN}\n| hand | written |\n{claims.END}\n\nafter\n")
    args = ["--readme", str(readme), "--book", str(tmp_path)]
    assert claims.main(args + ["--check"]) == 1
    assert claims.main(args) == 0
    assert claims.main(args + ["--check"]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n") and text.endswith("\n\nafter\n")
    assert read_section(results_readme, claims.DETAIL) == claims.detail()
    results_readme.write_text(results_readme.read_text().replace("(*reproduced", "(*hand-edited"))
    assert claims.main(args + ["--check"]) == 1
    assert claims.main(args) == 0
    index = tmp_path / "README.md"
    index.write_text(index.read_text().replace("**reproduced", "**hand-edited"))
    assert claims.main(args + ["--check"]) == 1


@pytest.mark.parametrize("step_ratio, speed", [(1.25, "0.80"), (0.5, "2.00")])
def test_step_time_ratios_are_written_as_speed(tmp_path, step_ratio, speed):
    """A step-time ratio to AdamW's is shown inverted: time 1.25× AdamW's is 0.80× its speed."""
    rows = _speed_rows(step_ratio)
    _write_csv(tmp_path / "gefen_speed.csv", rows)
    row = claims_gefen.gefen_speed(claims_common.Results(tmp_path))
    assert f"{speed}–{speed}× fused AdamW" in row.headline
    assert row.verdict.startswith("met" if step_ratio < 1 else "not met")
    assert "offload" not in row.verdict  # no offload rows: no offload verdict


SPEED_NAMES = ("Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored", "Gefen-4bit-factored", "Gefen-8bit-compact",
               "Gefen-4bit-compact")


def _speed_rows(step_ratio, names=SPEED_NAMES):
    rows = [_row(variant=f"{m}/{n}", metric="step_time_vs_adamw", x_name="threads", x_value=1, value=step_ratio)
            for m in ("transformer", "mlp", "small-tensors") for n in names]
    rows += [_row(variant=f"{m}/{n}", metric="step_time_vs_adamw", x_name="threads", x_value=1, value=30)
             for m in ("transformer", "mlp", "small-tensors") for n in ("torchao-AdamW8bit", "gefen-x")]
    rows += [_row(variant=n, metric=m, x_name="tensors", x_value=40, value=3 if m == "launches_per_step" else 0)
             for n in names for m in ("launches_per_step", "device_ops_per_step", "host_syncs_per_step")]
    return rows


@pytest.mark.parametrize("gefen_time, verdict", [(0.08, "met at offload scale"), (0.125, "not met at offload scale")])
def test_offload_rows_get_their_own_verdict_and_the_fastest_adamw(tmp_path, gefen_time, verdict):
    """Offload sets are judged on their own; the fastest AdamW is the faster of fused AdamW and
    DeepSpeed's CPU-Adam, whichever it is."""
    rows = _speed_rows(0.9)
    for prefix in ("offload-512M-fp32", "offload-512M-bf16"):
        times = {"AdamW": 0.1, "deepspeed-CPUAdam": 0.09, **dict.fromkeys(SPEED_NAMES, gefen_time)}
        for n, t in times.items():
            rows += [_row(variant=f"{prefix}/{n}", metric="step_time_median", x_name="threads", x_value=1, value=t),
                     _row(variant=f"{prefix}/{n}", metric="step_time_vs_adamw", x_name="threads", x_value=1,
                          value=t / 0.1)]
    _write_csv(tmp_path / "gefen_speed.csv", rows)
    row = claims_gefen.gefen_speed(claims_common.Results(tmp_path))
    assert verdict in row.verdict
    fused, fastest = 0.1 / gefen_time, 0.09 / gefen_time
    assert f"Offload scale, 512M-fp32 gradients: {fused:.2f}–{fused:.2f}× fused AdamW's speed, " \
           f"{fastest:.2f}–{fastest:.2f}× the fastest AdamW's" in row.detail



def test_peak_memory_verdict_judges_the_lean_mode_target_on_every_model():
    """The row states the lean mode's 4.5 B/param; its verdict judges it at every step of every model
    in the committed CSV (read here without the analysis's helpers) and names a miss with its size."""
    lean = "Gefen-8bit-factored+bf16-sr+in-backward"
    with open(RESULTS_DIR / "gefen_peak_memory.csv") as fh:
        peaks = [r for r in csv.DictReader(fh) if r["metric"] == "tensor_peak_per_param" and r["variant"].endswith(f"/{lean}")]
    first_mb = {}
    for r in peaks:  # each model at its first micro-batch, as the figure draws it
        first_mb.setdefault(r["variant"].split("/")[0], r["variant"].split("/")[1])
    top = max(float(r["value"]) for r in peaks if r["variant"].split("/")[1] == first_mb[r["variant"].split("/")[0]])
    row = claims_gefen.gefen_peak_memory(claims_common.Results())
    if top > 4.5:
        assert f"misses lean mode ≤ 4.5 B/param by {top - 4.5:.2f} ({top:.2f} on" in row.verdict, row.verdict
    else:
        assert "misses" not in row.verdict, row.verdict
    n = len(re.findall(r"\bmet\b|\bmissed\b", row.detail))
    assert re.match(rf"holds on \d of {n} targets", row.verdict), row.verdict


def _ablation_medians(name):
    """{(model label, variant): median over seeds of val_loss_vs_adamw} of ablation ``name``'s committed
    CSV, read here with the csv module (the first configuration's label from its config)."""
    import json
    import statistics

    first = json.loads((RESULTS_DIR / f"{name}.config.json").read_text())["config"]["label"]
    per = {}
    with open(RESULTS_DIR / f"{name}.csv") as fh:
        for r in csv.DictReader(fh):
            if r["metric"] == "val_loss_vs_adamw" and not r["variant"].endswith("AdamW"):
                label, _, variant = r["variant"].rpartition("/")
                per.setdefault((label or first, variant), []).append(float(r["value"]))
    return {k: statistics.median(v) for k, v in per.items()}


@pytest.mark.parametrize("row, ablations", list(claims_gefen.RESTS_ON.items()), ids=list(claims_gefen.RESTS_ON))
def test_ablation_backed_detail_quotes_every_variant_of_its_ablations(row, ablations):
    """A row's detail names each ablation it rests on and quotes each variant's median loss over AdamW's
    (of the model it quotes, or every model), as the CSV gives it."""
    detail = getattr(claims_gefen, row)(claims_common.Results()).detail
    for name, model in ablations:
        assert f"`{name}`" in detail, (row, name)
        medians = {k: m for k, m in _ablation_medians(name).items() if model in (None, k[0])}
        assert medians, (row, name, model)
        for (label, variant), med in medians.items():
            assert label in detail and f"`{variant}` {claims_common.pct(med)}" in detail, (row, name, label, variant)


def test_compact_layout_verdict_counts_the_models_within_the_loss_target():
    """The compact layout's loss verdict: on how many models its 8-bit variant's median loss ratio over
    AdamW's is within +0.3%, over the encoder's 15 seeds and the other models' (the candidates
    ablations, read here with csv; the first model's variants are unprefixed)."""
    import statistics

    ratios = {}
    for name in ("gefen_ablation_candidates", "gefen_ablation_candidates_models"):
        with open(RESULTS_DIR / f"{name}.csv") as fh:
            for r in csv.DictReader(fh):
                model, _, variant = r["variant"].rpartition("/")
                if r["metric"] == "val_loss_vs_adamw" and variant == "factored+layout_w16":
                    ratios.setdefault((name, model), []).append(float(r["value"]))
    within = sum(statistics.median(v) - 1 <= 0.003 for v in ratios.values())
    assert len(ratios) == 5
    verdict = claims_gefen.gefen_layout(claims_common.Results()).verdict
    assert f"loss within +0.3% of AdamW's on {within} of 5 models" in verdict
