"""analysis/dsa_out_of_core.py on a small fixture CSV: its figure and section, whose verdicts follow
the numbers in the CSV (each target met on one side of its threshold and missed on the other)."""

import pytest

from analysis import common, dsa_out_of_core
from tests.test_analysis import CONFIG, write


def rows(prefetch_ratio, exact_2gib, loss_ratio):
    cold = [("disk/QD1", "random_read_4KiB", 10_000.0), ("disk/QD32", "random_read_4KiB", 40_000.0),
            ("disk/QD1/exact", "cold_bound", 10_000.0), ("disk/QD32/exact", "cold_bound", 40_000.0)]
    for v in dsa_out_of_core.COLD:
        r = prefetch_ratio if v == "exact/prefetch" else 0.5
        cold += [(f"DiskSparseAdam/{v}", "cold_throughput", 40_000.0 * r),
                 (f"DiskSparseAdam/{v}", "cold_throughput_per_cpu_second", 90_000.0),
                 (f"DiskSparseAdam/{v}", "cold_over_QD1_bound", 4 * r), (f"DiskSparseAdam/{v}", "cold_over_QD32_bound", r)]
    cold += [("DiskSparseAdam/exact/warm", "warm_throughput", 100.0), ("DiskSparseAdam/compact/warm", "warm_throughput", 120.0),
             ("ratio", "compact_over_exact_warm", 1.2)]
    out = [(v, m, val, "config", "seed", 0) for v, m, val in cold]
    lim = "memory_limit_GiB"
    for x, sa, ex, co, peak_ex, peak_co in ((2.0, None, exact_2gib, 150.0, 2.0, 1.5), ("none", 90.0, 200.0, 200.0, 3.2, 1.5)):
        for v, thr, peak in (("SparseAdam", sa, 2.0), ("DiskSparseAdam/exact", ex, peak_ex),
                             ("DiskSparseAdam/compact", co, peak_co)):
            out += [(v, "completed", float(thr is not None), lim, x, 0), (v, "throughput", thr or 0.0, lim, x, 0),
                    (v, "peak_memory", peak * 2**30, lim, x, 0)]
    out += [("table", m, val, "config", "2000000x128", 0) for m, val in
            (("rows", 2e6), ("dim", 128), ("compact_bytes_per_row", 136))]
    for seed in range(3):
        out += [("DiskSparseAdam/exact", "final_val_loss", 2.0, "config", "kg", seed),
                ("DiskSparseAdam/compact", "final_val_loss", 2.0 * loss_ratio, "config", "kg", seed),
                ("code/linear-int8", "m_rel_rms_error", 0.006, "config", "kg", seed),
                ("code/codebook-256", "m_rel_rms_error", 0.005, "config", "kg", seed)]
    out.append(("ratio", "compact_over_exact_val_loss", loss_ratio, "config", "kg", 0))
    return out


@pytest.mark.parametrize("good", [True, False])
def test_section_verdicts_follow_the_csv(tmp_path, good):
    write(tmp_path, "dsa_out_of_core", rows(0.8 if good else 0.6, 30_000.0 if good else 20_000.0,
                                           1.005 if good else 1.02), CONFIG)
    out = tmp_path / "figs" / "dsa_out_of_core.png"
    common.main(dsa_out_of_core.REPORT, ["--results-dir", str(tmp_path), "--out", str(out)])
    section = common.read_section(tmp_path / "README.md", "dsa_out_of_core")
    assert out.exists() and out.stat().st_size > 10_000
    word = "met" if good else "missed"
    for target in ("cold steps with prefetch", "exact DSA at 2 GiB", "compact final loss within 1%"):
        line = next(ln for ln in section.splitlines() if ln.startswith(f"- {target}"))
        assert line.endswith(f"**{word}**."), line
    assert "compact at 2 GiB (exact pages, compact fits) ≥ 0.5 of its unlimited throughput: 0.75: **met**" in section
    assert "compact record ≤ D + 16 bytes: 136 B at D = 128: **met**" in section
    assert "| 2 | killed |" in section
