"""README section (no figure): a table of billions of parameters trained out of core on one small machine.

    python analysis/dsa_billions.py [--results-dir results]

Reads ``dsa_billions.csv``: per state format (variant ``DiskSparseAdam/<format>``, ``x_name="parameters"``)
cold and steady samples/s and rows/s, peak RSS, bytes on disk, bytes written per step and their
amplification, flush MiB/s; the scaling curve (variant ``DiskSparseAdam/compact/scaling``,
``x_name="rows"``); and how ``torch.optim.SparseAdam`` ended on the same table.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

from analysis.common import Report, fmt, main, md_table, select


def body(rows, config):
    c = config.get("config", {})
    formats = sorted({r["variant"] for r in rows if r["variant"].startswith("DiskSparseAdam/")
                      and not r["variant"].endswith("/scaling")})
    by = {(r["variant"], r["metric"]): r["value"] for r in rows}
    table = [[v.split("/", 1)[1], fmt(by[(v, "params")]), fmt(by[(v, "cold_samples_per_s")]),
              fmt(by[(v, "steady_samples_per_s")]), fmt(by[(v, "steady_rows_per_s")]),
              fmt(by[(v, "peak_rss_mib")]), fmt(by[(v, "bytes_on_disk")] / 2**30),
              fmt(by[(v, "write_bytes_per_step")] / 2**20), fmt(by[(v, "write_amplification")]),
              fmt(by[(v, "flush_mib_per_s")])] for v in formats]
    limit = c.get("memory_limit_gib")
    text = [(f"A table of {fmt(c.get('rows'))} rows × {c.get('dim', '?')} float32 values, its weights in a memory-"
             f"mapped file (`mapped_embedding`), batches of {c.get('batch', '?')} uniform rows, one thread, "
             f"{c.get('steps', '?')} steps per state format with the next batch prefetched; "
             + (f"the process in a memory cgroup of {limit} GiB, page cache included." if c.get("memory_cgroup")
                else "no memory cgroup (the page cache may hold what fits).")),
            md_table(["state", "parameters", "samples/s (first 10 steps)", "samples/s (steady)", "rows/s (steady)",
                      "peak RSS (MiB)", "on disk (GiB)", "written per step (MiB)", "written / rows' bytes",
                      "flush (MiB/s)"], table)]
    scaling = sorted((int(r["x_value"]), r["value"]) for r in select(rows, "steady_rows_per_s",
                                                                      "DiskSparseAdam/compact/scaling"))
    if scaling:
        text.append(f"Rows/s by table size ({c.get('scale_dim', '?')} values a row, compact state, same budget): "
                    + ", ".join(f"{fmt(n)} rows: {fmt(v)}" for n, v in scaling)
                    + ". For scale: NVIDIA HierarchicalKV publishes 40M rows/s on an A100 with host memory, "
                    "FBGEMM's RocksDB-backed tables read checkpoints at 341 MiB/s.")
    if ("SparseAdam", "needed_bytes") in by:
        text.append(f"`torch.optim.SparseAdam` on the same table needs {fmt(by[('SparseAdam', 'needed_bytes')] / 2**30)} "
                    f"GiB in RAM (weights and two moments); run in {fmt(by[('SparseAdam', 'memory_limit')] / 2**30)} GiB: "
                    f"{c.get('sparse_adam_outcome', 'not run')}.")
    return "\n\n".join(text)


REPORT = Report("dsa_billions", "dsa_billions", "Billions of parameters on one small machine", body,
                metrics=("steady_samples_per_s",))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
