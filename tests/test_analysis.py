"""analysis/: every script on a small fixture CSV writes its PNG and its README section, whose
numbers equal what the test computes from the CSV; sections are replaced in place; bad input fails
with a message that names the file."""

import csv
import json
import re
import statistics

import pytest

from analysis import (codebook, common, convergence, correctness, dsa_throughput, gefen_ablation, gefen_memory,
                      gefen_speed, hessian_alignment, poincare)
from experiments.harness.common import FIELDS

CONFIG = {"config": {"steps": 10}, "git_commit": "abc1234", "device": "cpu:Test CPU x2",
          "torch_version": "2.13.0+cpu", "command": "python experiments/demo.py --quick",
          "wall_seconds": 75.0, "timestamp": "2026-01-01T00:00:00+00:00"}


def write(tmp_path, experiment, rows, config=CONFIG):
    """Write rows (variant, metric, value, x_name, x_value, seed) as a results CSV and its config."""
    with open(tmp_path / f"{experiment}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for variant, metric, value, x_name, x_value, seed in rows:
            w.writerow(dict(experiment=experiment, variant=variant, metric=metric, unit="", x_name=x_name,
                            x_value=x_value, value=value, seed=seed, device=config["device"],
                            torch_version=config["torch_version"], git_commit=config["git_commit"],
                            timestamp=config["timestamp"]))
    (tmp_path / f"{experiment}.config.json").write_text(json.dumps(config))


def poincare_rows():
    return [(v, m, val * (1 + 0.1 * d), "dim", d, 0) for v, val in
            (("DiskSparseRiemannianAdam", 0.5), ("geoopt-SparseRiemannianAdam", 0.5), ("DiskSparseAdam+clip", 0.02))
            for m in ("map", "mean_rank") for d in (2, 5)]


def convergence_rows():
    rows = []
    for k, name in enumerate(("AdamW", "Gefen-8bit", "Gefen-4bit")):
        rows.append((name, "best_lr", 3e-3, "selected_by", "lr_sweep_val_loss", 0))
        rows += [(name, "lr_sweep_val_loss", 2.5 + k / 100 + lr, "lr", lr, 0) for lr in (1e-3, 3e-3)]
        for seed in range(3):
            final = 2.5 + 0.01 * k + 0.003 * seed * k
            rows += [(name, "val_loss", final + 1 / (s + 1), "step", s, seed) for s in (0, 5, 10)]
            rows += [(name, "final_val_loss", final, "lr", 3e-3, seed),
                     (name, "state_bytes_per_param", 8.0 / (k + 1), "lr", 3e-3, seed),
                     (name, "step_time", 1.0 + k, "lr", 3e-3, seed), (name, "params", 1000, "lr", 3e-3, seed)]
    finals = {(r[0], r[5]): r[2] for r in rows if r[1] == "final_val_loss"}
    rows += [(n, "val_loss_vs_adamw", finals[(n, s)] / finals[("AdamW", s)], "model", "char-gpt-1k", s)
             for n, s in finals]
    return rows


def gefen_memory_rows():
    rows = []
    for m in ("transformer", "mlp"):
        for k, (name, bpp, ms) in enumerate((("AdamW", 8.0, 5.0), ("Gefen-8bit", 1.04, 10.0), ("Gefen-4bit", 0.6, 9.0))):
            rows += [(name, "state_bytes_per_param", bpp, "model", m, 0), (name, "step_time_median", ms / 1e3, "model", m, 0),
                     (name, "step_time_vs_adamw", ms / 5.0, "model", m, 0), (name, "threads", 1, "model", m, 0)]
    return rows


SPEED_MS = {"AdamW": 4.0, "Gefen-8bit": 3.6, "Gefen-4bit": 4.4, "Gefen-8bit-factored": 4.0, "Gefen-4bit-factored": 4.62,
            "Gefen-8bit-compact": 3.9, "Gefen-4bit-compact": 4.1,
            "torchao-AdamW8bit": 40.0, "gefen-x": 80.0}


def gefen_speed_rows():
    """CPU rows at 1 and 2 threads, the Triton path's counts, and a GPU set."""
    rows = []
    for t in (1, 2):
        for m, scale in (("transformer", 1.0), ("mlp", 0.5), ("small-tensors", 0.25)):
            for name, ms in SPEED_MS.items():
                v, s = f"{m}/{name}", ms * scale / 1e3 / t
                rows += [(v, "step_time_median", s, "threads", t, 0), (v, "threads", t, "threads", t, 0),
                         (v, "step_time_vs_adamw", ms / SPEED_MS["AdamW"], "threads", t, 0)]
                if name.endswith("-factored"):
                    rows.append((v, "step_time_vs_unfactored", ms / SPEED_MS[name.removesuffix("-factored")],
                                 "threads", t, 0))
                if m == "small-tensors":
                    rows.append((v, "host_us_per_tensor", s / 160 * 1e6, "threads", t, 0))
    counts = {"AdamW": ((2, 0), (2, 0)), "Gefen-8bit": ((0, 3), (0, 2)), "Gefen-8bit-factored": ((4280, 2), (17122, 2))}
    for name, per_size in counts.items():
        for k, (ops, launches) in zip((40, 160), per_size):
            rows += [(name, "device_ops_per_step", ops, "tensors", k, 0), (name, "launches_per_step", launches, "tensors", k, 0),
                     (name, "aten_ops_per_step", ops + 2, "tensors", k, 0), (name, "host_syncs_per_step", 0, "tensors", k, 0)]
    for name, ms in (("AdamW", 2.16), ("Gefen-8bit", 12.8), ("Gefen-8bit-factored", 14.0)):
        v = f"gpt2-125M/{name}"
        rows += [(v, "step_time_median", ms / 1e3, "params", 124439808, 0),
                 (v, "step_time_vs_adamw", ms / 2.16, "params", 124439808, 0),
                 (v, "host_time_median", 0.5e-3, "params", 124439808, 0),
                 (v, "host_us_per_tensor", 0.5e-3 / 148 * 1e6, "params", 124439808, 0)]
    rows.append(("gpt2-125M/Gefen-8bit-factored", "step_time_vs_unfactored", 14.0 / 12.8, "params", 124439808, 0))
    return rows


def dsa_rows():
    rows = []
    for cfg, s in (("seed", 1.0), ("kg", 0.3)):
        for what, v in (("ceiling", 3e5), ("SparseAdam", 4e4), ("DiskSparseAdam/warm", 1e5),
                        ("DiskSparseAdam/warm-fused", 1.2e5), ("DiskSparseAdam/cold", 5e3)):
            rows.append((f"{cfg}/{what}", "throughput", v * s, "config", cfg, 0))
        rows += [(f"{cfg}/disk", "cold_bound", 1e4 * s, "config", cfg, 0),
                 (f"{cfg}/ratio", "DiskSparseAdam_warm/SparseAdam", 2.5, "config", cfg, 0),
                 (f"{cfg}/ratio", "DiskSparseAdam_warm/ceiling", 1 / 3 + s / 5, "config", cfg, 0),
                 (f"{cfg}/ratio", "DiskSparseAdam_cold/disk_bound", 0.5, "config", cfg, 0),
                 (f"{cfg}/SparseAdam", "state_bytes_in_ram", 2.0**30 * s, "config", cfg, 0),
                 (f"{cfg}/DiskSparseAdam", "rss_anon_delta", 3.0, "config", cfg, 0),
                 (f"{cfg}/DiskSparseAdam", "bytes_on_disk", 2.0**30 * s, "config", cfg, 0)]
    return rows


def ablation_rows():
    return [(v, "val_loss_vs_adamw", 1 + d + 0.01 * s, "steps", 10, s)
            for v, d in (("none", 0.04), ("all", 0.0), ("in_proj", 0.01)) for s in range(3)]


def hessian_rows():
    rows = []
    for kind in ("transformer", "mlp"):
        rows.append((kind, "n_params", 100, "", "", 0))
        for step in (0, 10):
            rows.append((kind, "spearman_spread", -0.05 * (step + 1), "step", step, 0))
            for dec in (1, 2):
                rows += [(f"{kind}/step{step}", m, v * dec, "coupling_decile", dec, 0)
                         for m, v in (("coupling_median", 0.1), ("spread_median", 3.0), ("level_median", 1.0))]
            for sch, c in (("gefen", 0.5), ("random_gefen", 0.2)):
                rows += [(f"{kind}/{sch}", "coupling_within", c, "step", step, 0),
                         (f"{kind}/{sch}", "dispersion", 1 - c, "step", step, 0),
                         (f"{kind}/{sch}", "spread_within", 3.0, "step", step, 0)]
        rows += [(f"{kind}/{s}", "val_loss", 1.7 + d, "steps", 10, seed)
                 for s, d in (("adamw", 0.0), ("gefen", 0.002), ("random_gefen", 0.003)) for seed in (0, 1)]
    return rows


def codebook_rows():
    rows = []
    for k in (16, 256):
        for bins in (256, 512):
            for impl, t in (("ours-numba", 1e-3), ("ours-numpy", 1e-2), ("upstream", 1e-1)):
                rows.append((f"{impl}/K{k}", "dp_cpu_time", t * bins / 256, "bins", bins, 0))
                if impl != "upstream":
                    rows += [(f"{impl}/K{k}", "cpu_speedup_vs_upstream", 1e-1 / t, "bins", bins, 0),
                             (f"{impl}/K{k}", "cost_rel_diff_vs_upstream", 1e-12, "bins", bins, 0)]
    rows += [(f"{c}/{b}/{bl}", "rel_mse", e, "", "", 0) for c, e in (("learned", 1e-4), ("linear", 2e-4))
             for b in ("8bit", "4bit") for bl in ("absmax256", "gefen")]
    return rows


def correctness_rows():
    return [(v, m, e, "steps", 20, 0) for v, e in (("DiskSparseAdam[numba] vs torch.optim.SparseAdam", 0.0),
                                                  ("Gefen[triton,8-bit] vs Gefen[torch,8-bit]", 1.5e-8))
            for m in ("max_abs_err", "rel_rms_err")]


SCRIPTS = [(poincare, poincare_rows), (convergence, convergence_rows), (gefen_memory, gefen_memory_rows),
           (gefen_speed, gefen_speed_rows),
           (dsa_throughput, dsa_rows), (gefen_ablation, ablation_rows), (hessian_alignment, hessian_rows),
           (codebook, codebook_rows), (correctness, correctness_rows)]


def run(module, tmp_path):
    out = tmp_path / "figs" / f"{module.REPORT.name}.png"
    argv = ["--results-dir", str(tmp_path)] + (["--out", str(out)] if module.REPORT.draw else [])
    common.main(module.REPORT, argv)
    return out, common.read_section(tmp_path / "README.md", module.REPORT.name)


@pytest.mark.parametrize("module, rows", SCRIPTS, ids=[m.REPORT.name for m, _ in SCRIPTS])
def test_script_writes_figure_and_section(tmp_path, module, rows):
    write(tmp_path, module.REPORT.experiment, rows())
    out, section = run(module, tmp_path)
    if module.REPORT.draw:
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
        assert f"![{module.REPORT.name}](figs/{module.REPORT.name}.png)" in section
    assert section.startswith(f"## {module.REPORT.title}")
    for part in ("commit `abc1234`", "cpu:Test CPU x2", "torch 2.13.0+cpu", "wall time 75 s",
                 "`python experiments/demo.py --quick`"):
        assert part in section
    assert "|---|" in section


def _row(section, first_cell):
    line = next(ln for ln in section.splitlines() if ln.startswith(f"| {first_cell} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_convergence_numbers_come_from_the_csv(tmp_path):
    rows = convergence_rows()
    write(tmp_path, "convergence", rows)
    _, section = run(convergence, tmp_path)
    finals = [r[2] for r in rows if r[:2] == ("Gefen-4bit", "final_val_loss")]
    ratios = [r[2] for r in rows if r[:2] == ("Gefen-4bit", "val_loss_vs_adamw")]
    cells = _row(section, "**Gefen-4bit**")
    assert cells[2] == f"{statistics.fmean(finals):.4f} ± {statistics.stdev(finals):.4f}"
    assert cells[5] == f"{statistics.fmean(ratios):.3f} ± {statistics.stdev(ratios):.3f}"
    assert (f"median {statistics.median(ratios) - 1:+.2%} (mean {statistics.fmean(ratios) - 1:+.2%}) against AdamW"
            in section)


def test_convergence_bytes_cap_holds_from_the_target_width():
    """A model narrower than TARGET_WIDTH has no bytes cap (its vectors weigh more); from that width
    on, and where the config gives no width, the cap is judged, equal bytes meeting it."""
    judged = convergence._bytes_judged
    assert judged(1.30, 1.06, common.TARGET_WIDTH - 1).startswith(f"no cap at width {common.TARGET_WIDTH - 1}")
    assert judged(1.07, 1.06, common.TARGET_WIDTH).startswith("**not met**")
    assert judged(1.06, 1.06, 4 * common.TARGET_WIDTH).startswith("**met**")
    assert judged(1.07, 1.06, None).startswith("**not met**")


def test_gefen_memory_numbers_and_verdicts(tmp_path):
    write(tmp_path, "gefen_memory", gefen_memory_rows())
    _, section = run(gefen_memory, tmp_path)
    assert _row(section, "**Gefen-8bit**")[1:] == ["1.040", "10", "2"]
    assert "Gefen-4bit on mlp: 0.600 B/param (target ≤ 0.55: missed)" in section
    assert "Gefen-8bit on transformer: 1.040 B/param (target ≤ 1.05: met)" in section


def test_gefen_speed_numbers_and_verdicts(tmp_path):
    """Every ratio and target of the section is a speed (fused AdamW's step time / ours), as in the claims table."""
    write(tmp_path, "gefen_speed", gefen_speed_rows())
    _, section = run(gefen_speed, tmp_path)
    cells = _row(section, "**Gefen-4bit**")
    assert cells[1] == "0.909× (4.4 ms)" and cells[3] == "0.909× (1.1 ms)" and cells[4] == "0.909× (2.2 ms)"
    counts = section[section.index("The Triton path"):]
    assert _row(counts, "**Gefen-8bit-factored**")[1:6] == ["4,280", "17,122", "2", "2", "0"]
    assert _row(counts, "AdamW (fused, reference)")[1:5] == ["2", "2", "0", "0"]
    assert ("- Gefen-8bit on transformer, 1 thread: 1.11× fused AdamW's speed (target ≥ 1×: met; stretch ≥ 1.4×: "
            "missed).") in section
    assert "- Gefen-4bit on mlp, 1 thread: 0.909× fused AdamW's speed (target ≥ 1×: missed;" in section
    assert "- Gefen-4bit-factored on transformer, 1 thread: 0.952× Gefen-4bit's speed (target ≥ 0.91×: met)." in section
    assert ("- Gefen-8bit, Triton path: 0 device ops and 3 launches at 40 tensors, 0 device ops and 2 launches at 160 "
            "tensors (target ≤ 8 each: met; the same at every tensor count: missed, fewer at more tensors: one "
            "launch per block length of the model).") in section
    assert "- Gefen-8bit-factored, Triton path: 4,280 device ops" in section
    assert "- Gefen-8bit on the GPU, gpt2-125M: 0.169× fused AdamW's speed (target ≥ 1×: missed)." in section
    assert "0.914× the unfactored's speed (target ≥ 0.87×: met)" in section


def test_gefen_speed_small_tensor_target_is_the_claims_speed_target(tmp_path):
    """The section judges the model of many small tensors by the claims row's target, "≥ 1× fused
    AdamW's speed": a step at 1.1× AdamW's time (0.909× its speed) misses it in both."""
    from analysis.claims_common import Results
    from analysis.claims_gefen import gefen_speed as speed_row

    write(tmp_path, "gefen_speed", gefen_speed_rows())
    _, section = run(gefen_speed, tmp_path)
    assert "- Gefen-4bit on 160 small tensors, 1 thread: 0.909× fused AdamW's speed (target ≥ 1×: missed)." in section
    row = speed_row(Results(tmp_path))
    assert "≥ 1× fused AdamW's speed" in row.claim and "not met for many small tensors" in row.verdict


def _spread(rows):
    """The fixture with ratios over five decades (a loaded machine's, or a slow peer's)."""
    out = []
    for v, m, val, xn, xv, seed in rows:
        if m == "step_time_vs_adamw" and v.endswith("gefen-x"):
            val *= 20
        elif m == "step_time_vs_adamw" and xv == 2 and v.endswith("Gefen-8bit"):
            val *= 0.005
        out.append((v, m, val, xn, xv, seed))
    return out


@pytest.mark.parametrize("spread", [False, True], ids=["fixture", "wide-ratios"])
def test_gefen_speed_figure_is_laid_out_without_overlaps(spread):
    """The figure: constrained layout, every label and legend inside the figure, no two panels (with
    their legends and labels) overlapping, no tick label on another, no legend over its panel's labels."""
    import matplotlib.pyplot as plt

    fixture = _spread(gefen_speed_rows()) if spread else gefen_speed_rows()
    rows = [dict(variant=v, metric=m, value=float(val), x_name=xn, x_value=xv, device="cuda:NVIDIA H100 80GB HBM3")
            for v, m, val, xn, xv, _ in fixture]
    fig = gefen_speed.figure(rows)
    try:
        assert type(fig.get_layout_engine()).__name__ == "ConstrainedLayoutEngine"
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert len(fig.axes) == 3
        inside = fig.bbox.padded(1)

        def box(a):
            return a.get_window_extent(renderer)

        def apart(a, b):
            return not a.overlaps(b) or (a.x1 - b.x0 < 1 or b.x1 - a.x0 < 1 or a.y1 - b.y0 < 1 or b.y1 - a.y0 < 1)

        tight = [ax.get_tightbbox(renderer) for ax in fig.axes]
        for i in range(len(tight)):
            assert inside.contains(tight[i].x0, tight[i].y0) and inside.contains(tight[i].x1, tight[i].y1)
            for j in range(i + 1, len(tight)):
                assert apart(tight[i], tight[j]), f"panels {i} and {j} overlap"
        for ax in fig.axes:
            legend = ax.get_legend()
            lo, hi = sorted(ax.get_xlim())
            xticks = [t for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi]  # the ones drawn
            for ticks in (ax.get_yticklabels(), xticks):
                shown = [t for t in ticks if t.get_text()]
                for a, b in zip(shown, shown[1:]):
                    assert apart(box(a), box(b)), (a.get_text(), b.get_text())
            for t in [ax.xaxis.label, ax.title] + [t for t in ax.get_xticklabels() if t.get_text()]:
                assert apart(box(legend), box(t)), f"the legend covers {t.get_text()!r}"
            assert apart(box(legend), ax.bbox), "the legend lies over the data"
    finally:
        plt.close(fig)


def test_gefen_speed_quick_results_draw_beside_them_without_verdicts(tmp_path):
    write(tmp_path, "gefen_speed", gefen_speed_rows(), config=dict(CONFIG, config={"quick": True, "repeats": 7}))
    common.main(gefen_speed.REPORT, ["--results-dir", str(tmp_path)])
    assert (tmp_path / "gefen_speed.png").read_bytes()[:4] == b"\x89PNG"
    section = common.read_section(tmp_path / "README.md", "gefen_speed")
    assert "no verdicts" in section and "(target" not in section


def test_dsa_targets_follow_the_ratios(tmp_path):
    write(tmp_path, "dsa_throughput", dsa_rows())
    _, section = run(dsa_throughput, tmp_path)
    assert "warm / ceiling ≥ 0.5: met on seed; missed on kg." in section
    assert _row(section, "seed")[1] == "300,000"


def test_poincare_table_matches_csv(tmp_path):
    write(tmp_path, "poincare", poincare_rows())
    _, section = run(poincare, tmp_path)
    assert _row(section, "DiskSparseRiemannianAdam")[1:] == ["0.6 / 0.75", "0.6 / 0.75"]


def test_sections_are_replaced_in_place_and_others_kept(tmp_path):
    readme = tmp_path / "README.md"
    common.write_section(readme, "a", "first A")
    common.write_section(readme, "b", "first B")
    common.write_section(readme, "a", "second A\nwith two lines")
    text = readme.read_text()
    assert text.count("<!-- begin a -->") == 1 and "first A" not in text
    assert text.index("second A") < text.index("first B")
    assert common.read_section(readme, "b") == "first B"
    before = text
    common.write_section(readme, "a", "second A\nwith two lines")
    assert readme.read_text() == before


def test_every_page_of_the_committed_book_has_its_head_and_its_sections_in_order():
    """Each page of the results book starts with the head a new page gets and holds the sections its
    entry of analysis/book.py's PAGES lists, in experiments/reproduce.py's order."""
    from analysis import book
    from experiments.harness.common import RESULTS_DIR

    order = common.section_order()
    for page, (_, sections) in book.PAGES.items():
        doc = (RESULTS_DIR / f"{page}.md").read_text()
        assert doc.startswith(book.head(page)), page
        names = [n for n in re.findall(r"^<!-- begin (\S+) -->$", doc, re.M) if n != "contents"]
        assert names == sections == sorted(sections, key=order.index), page


def test_sections_come_in_reproduce_order_whatever_order_they_are_written_in(tmp_path):
    """Sections sort by experiments/reproduce.py's list (the claims' detail first, a name it does not
    know last); text written by hand between sections leaves the order alone."""
    readme = tmp_path / "README.md"
    for name in ["kernel_resources", "mine", "gefen_ablation", "convergence", "correctness", common.DETAIL]:
        common.write_section(readme, name, f"## {name}\n\nbody of {name}")
    doc = readme.read_text()
    shown = [line[3:] for line in doc.splitlines() if line.startswith("## ")]
    assert shown == [common.DETAIL, "correctness", "convergence", "gefen_ablation", "kernel_resources", "mine"]
    listed = [line for line in doc.splitlines() if line.startswith("- [")]
    assert [item[3:item.index("]")] for item in listed] == shown
    for name in shown:
        assert common.read_section(readme, name) == f"## {name}\n\nbody of {name}"

    by_hand = doc.replace("<!-- end correctness -->\n", "<!-- end correctness -->\n\nA note by hand.\n")
    readme.write_text(by_hand)
    common.write_section(readme, "dsa_throughput", "## dsa_throughput\n\nnew")
    doc = readme.read_text()
    assert "A note by hand." in doc and doc.index("## dsa_throughput") > doc.index("## mine")


def test_rerun_of_a_script_keeps_other_sections(tmp_path):
    write(tmp_path, "gefen_ablation", ablation_rows())
    write(tmp_path, "correctness", correctness_rows())
    run(gefen_ablation, tmp_path)
    run(correctness, tmp_path)
    run(gefen_ablation, tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert text.count("<!-- begin gefen_ablation -->") == 1
    assert common.read_section(tmp_path / "README.md", "correctness") is not None


def test_malformed_csv_names_the_file(tmp_path):
    write(tmp_path, "poincare", poincare_rows())
    lines = (tmp_path / "poincare.csv").read_text().splitlines()
    cells = lines[1].split(",")
    cells[FIELDS.index("value")] = "oops"
    (tmp_path / "poincare.csv").write_text("\n".join([lines[0], ",".join(cells)] + lines[2:]) + "\n")
    with pytest.raises(common.ResultsError, match=r"poincare\.csv: malformed"):
        run(poincare, tmp_path)


def test_missing_metric_and_missing_file_are_named(tmp_path):
    write(tmp_path, "poincare", [r for r in poincare_rows() if r[1] != "map"])
    with pytest.raises(common.ResultsError, match=re.escape("poincare.csv: no rows of metric(s) ['map']")):
        run(poincare, tmp_path)
    with pytest.raises(FileNotFoundError, match="convergence.csv"):
        run(convergence, tmp_path)


def test_figure_link_is_relative_to_the_readme(tmp_path):
    quick = tmp_path / "results" / "quick"
    quick.mkdir(parents=True)
    write(quick, "poincare", poincare_rows())
    out = tmp_path / "paper_figs" / "quick" / "poincare.png"
    common.main(poincare.REPORT, ["--results-dir", str(quick), "--out", str(out)])
    assert "![poincare](../../paper_figs/quick/poincare.png)" in (quick / "README.md").read_text()


@pytest.mark.parametrize("name", ["convergence_long", "convergence_long_lr"])
def test_convergence_long_compares_the_gap_with_the_short_run_on_the_same_seeds(tmp_path, name):
    """analysis/convergence_long.py (and convergence_long_lr.py, its run at a fixed lr): per optimizer
    the median of its drop-in ratio over the seeds that both runs trained, at 1,000 steps
    (convergence_encoder.csv) and at 3,000, and whether the gap did not grow; without the short run's
    CSV the section says so instead of failing."""
    convergence_long = __import__(f"analysis.{name}", fromlist=["REPORT"])

    rng = __import__("random").Random(7)
    long_ratio = {("Gefen-8bit-factored", s): 1 + rng.uniform(-0.01, 0.02) for s in range(3)}
    long_ratio.update({("gefen-x", s): 1 + rng.uniform(0.0, 0.02) for s in range(3)})
    short_ratio = {(n, s): 1 + rng.uniform(-0.01, 0.02) for n in ("Gefen-8bit-factored", "gefen-x") for s in range(5)}

    def rows_of(ratio, lr):
        rows = [("dropin/AdamW", "final_val_loss", 1.5, "lr", lr, 0)]
        for (n, s), r in ratio.items():
            rows += [(f"dropin/{n}", "val_loss_vs_adamw", r, "model", "char-encoder-1k", s),
                     ("dropin/AdamW", "val_loss_vs_adamw", 1.0, "model", "char-encoder-1k", s)]
        return rows

    long_rows = [r for r in convergence_rows()] + rows_of(long_ratio, 2e-3)
    write(tmp_path, name, long_rows)
    _, alone = run(convergence_long, tmp_path)
    assert "`convergence_encoder.csv` is not in the results folder" in alone
    write(tmp_path, "convergence_encoder", rows_of(short_ratio, 4e-3))
    _, section = run(convergence_long, tmp_path)
    for name in ("Gefen-8bit-factored", "gefen-x"):
        at_long = statistics.median(long_ratio[(name, s)] for s in range(3))
        at_short = statistics.median(short_ratio[(name, s)] for s in range(3))  # seeds 3, 4: the short run's only
        row = next(line for line in section.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:4] == [f"{at_short - 1:+.2%}", f"{at_long - 1:+.2%}", f"{at_long - at_short:+.2%}"]
        assert cells[4] == ("**met**" if at_long <= at_short else "**not met**")
    assert "AdamW's best lr 0.004) and at 3,000 steps (this run, AdamW's best lr 0.002)" in section


def test_the_results_book_lists_every_section_once_after_each_write(tmp_path):
    """write_section keeps one contents list, made from the headings: a new section is listed in
    order, a rewritten one once, with GitHub's anchors."""
    from analysis.common import write_section

    readme = tmp_path / "README.md"
    readme.write_text("# Results\n\nIntro.\n\n## Claims in detail\n\nText.\n")
    write_section(readme, "a", "## Gefen: step time (CPU, 1 thread)\n\nx")
    write_section(readme, "b", "## The seed's own benchmark\n\ny")
    write_section(readme, "a", "## Gefen: step time (CPU, 1 thread)\n\nz")
    doc = readme.read_text()
    assert doc.count("<!-- begin contents -->") == 1 and doc.index("<!-- end contents -->") < doc.index("## Claims")
    listed = [line for line in doc.splitlines() if line.startswith("- [")]
    assert listed == ["- [Claims in detail](#claims-in-detail)",
                      "- [Gefen: step time (CPU, 1 thread)](#gefen-step-time-cpu-1-thread)",
                      "- [The seed's own benchmark](#the-seeds-own-benchmark)"]
    assert "\nz\n" in doc and "\nx\n" not in doc


def test_gefen_ablation_frontier_points_and_widths():
    """The frontier keeps every row whose bytes are known, once per (variant, model, steps, seeds), the
    first ablation's; a peer goes to its own code width, a variant to its ablation's."""
    S = gefen_ablation.SummaryRow
    nan = float("nan")
    table = [S("gefen_ablation_where", "factored", "enc", 1000, 15, 1.002, None, 1.19),
             S("gefen_ablation_where", "factored+attn_qkv", "enc", 1000, 15, 1.001, (0.0, 0.1), 1.31),
             S("gefen_ablation_where", "factored+mlp_in", "enc", 1000, 15, 1.0, (0.0, 0.1), nan),
             S("gefen_ablation_seeds", "factored", "enc", 1000, 15, 1.005, None, 1.18),
             S("gefen_ablation_seeds", "Gefen-4bit-factored", "enc", 1000, 15, 1.007, (0.1, 0.1), 0.69),
             S("gefen_ablation_seeds", "gefen-x", "enc", 1000, 15, 1.01, (0.5, 0.1), 1.05),
             S("gefen_ablation_4bit", "factored", "enc", 1000, 5, 1.008, None, 0.69)]
    front = gefen_ablation.frontier(table)
    assert front[8] == [("factored", "enc", 1000, 15, 1.19, 1.002), ("factored+attn_qkv", "enc", 1000, 15, 1.31, 1.001),
                        ("gefen-x", "enc", 1000, 15, 1.05, 1.01)]
    assert front[4] == [("Gefen-4bit-factored", "enc", 1000, 15, 0.69, 1.007), ("factored", "enc", 1000, 5, 0.69, 1.008)]


@pytest.mark.parametrize("triad, expected", [(20.0, 36.0), (50.0, 50.0)])
def test_offload_floor_time_is_at_the_highest_bandwidth_the_set_reached(tmp_path, triad, expected):
    """The floor's time divides by the triad's bandwidth or, where a step moved more (a read-modify-write
    step can outrun the triad), by that step's: a floor no optimizer beats in the same run."""
    prefix = "offload-512M-fp32"
    rows = [("memory/triad", "bandwidth", triad, "threads", 1, 0)]
    for name, gbps, floor in (("AdamW", 36.0, 28.0), ("Gefen-8bit", 5.0, 14.0)):
        rows += [(f"{prefix}/{name}", "gbps_effective", gbps, "threads", 1, 0),
                 (f"{prefix}/{name}", "bytes_floor", floor, "threads", 1, 0)]
    write(tmp_path, "gefen_speed", rows)
    loaded = common.load_rows("gefen_speed", tmp_path)
    assert gefen_speed.best_gbps(loaded, prefix, 1) == pytest.approx(expected)
    assert gefen_speed.best_gbps(loaded, prefix, 2) != gefen_speed.best_gbps(loaded, prefix, 2)  # nothing at 2: NaN


def test_a_run_before_a_registry_name_changed_says_what_it_measured():
    """The setup line of a run whose rows hold a changed registry name (alone or after a model's prefix)
    and whose timestamp precedes the change says what the name stood for then; a later run, or one
    without the name, says nothing of it."""
    names = {"Gefen-8bit-compact": (("2026-12-07T18:39:00+00:00", "the old record"),
                                    ("2026-12-07T22:00:00+00:00", "the newer record"))}
    rows = [{"variant": "char-gpt-116k/Gefen-8bit-compact", "git_commit": "abc"}, {"variant": "AdamW", "git_commit": "abc"}]
    before, after = ({"git_commit": "abc", "timestamp": t} for t in ("2026-12-06T10:00:00+00:00", "2026-12-08T12:00:00+00:00"))
    assert common.measured_before(before, rows, names) == [("Gefen-8bit-compact", "the old record")]
    between = {"git_commit": "abc", "timestamp": "2026-12-07T19:00:00+00:00"}
    assert common.measured_before(between, rows, names) == [("Gefen-8bit-compact", "the newer record")]
    assert common.measured_before(after, rows, names) == []
    assert common.measured_before(before, rows[1:], names) == []
    assert common.measured_before({}, [dict(r, timestamp="2026-12-01T00:00:00+00:00") for r in rows], names)
    line = common.setup_line(before, rows)
    assert "**Gefen-8bit-compact in this run is the compact layout with one fp32 column factor a matrix" in line
    assert "in this run is" not in common.setup_line(after, rows)
