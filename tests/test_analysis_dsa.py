"""analysis/: the DSA throughput figure from a fixture CSV, and the latest-run selection."""

import argparse

from analysis import dsa_throughput
from analysis.common import latest_run
from experiments.common import Results, add_common_args, read_results


def _results(tmp_path, name):
    args = add_common_args(argparse.ArgumentParser()).parse_args(
        ["--wandb", "disabled", "--results-dir", str(tmp_path)])
    return Results(name, args)


def test_latest_run_keeps_only_the_newest_run_per_variant(tmp_path):
    old = _results(tmp_path, "demo")
    old.timestamp = "2026-01-01T00:00:00+00:00"
    old.add("a", "t", "s", 1.0)
    old.add("b", "t", "s", 2.0)
    old.flush()
    new = _results(tmp_path, "demo")
    new.timestamp = "2026-02-01T00:00:00+00:00"
    new.add("a", "t", "s", 3.0)
    new.add("a", "u", "s", 4.0)
    new.flush()
    kept = latest_run(read_results("demo", tmp_path))
    assert sorted((r["variant"], r["metric"], r["value"]) for r in kept) == [
        ("a", "t", 3.0), ("a", "u", 4.0), ("b", "t", 2.0)]


def test_dsa_throughput_figure_from_fixture(tmp_path):
    with _results(tmp_path, "dsa_throughput") as res:
        for cfg, scale in (("seed", 1.0), ("kg", 0.3)):
            x = dict(x_name="config", x_value=cfg)
            for variant, v in (("ceiling", 3e5), ("SparseAdam", 4e4), ("DiskSparseAdam/warm", 1e5),
                               ("DiskSparseAdam/cold", 5e3)):
                res.add(f"{cfg}/{variant}", "throughput", "samples/s", v * scale, **x)
            res.add(f"{cfg}/disk", "cold_bound", "samples/s", 1e4 * scale, **x)
            res.add(f"{cfg}/SparseAdam", "state_bytes_in_ram", "bytes", 1e9 * scale, **x)
            res.add(f"{cfg}/DiskSparseAdam", "rss_anon_delta", "MiB", 3.0, **x)
            res.add(f"{cfg}/DiskSparseAdam", "bytes_on_disk", "bytes", 1e9 * scale, **x)
    out = tmp_path / "fig.png"
    assert dsa_throughput.main(["--results-dir", str(tmp_path), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
