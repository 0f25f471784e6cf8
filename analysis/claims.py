"""The README's claims table and results/README.md's "Claims in detail", generated from the results.

    python analysis/claims.py            # rewrite the README's claims table, results/claims.md and results/README.md
    python analysis/claims.py --check    # exit 1 if any of them differs from what would be written

One function per row reads the CSVs of ``results/`` (and ``results/gpu/``) and returns the row's
cells: the claim, a verdict in plain words, a short headline figure formatted from the data, the
figure and the command, and the detail paragraph (the conditions and caveats behind the headline,
formatted from the same values, so the table and the detail cannot disagree). The detail block adds,
for every CSV a row read, the run's commit, seeds and command and a link to the section with the full
tables. results/README.md, the index of the results book (analysis/book.py), holds the claims'
verdicts and the list of pages. Every ratio is a speed ("×" = times as fast as the named baseline) unless the text says
"times ... time", memory is bytes per parameter or MiB, loss is a percentage above or below AdamW's.
A row whose CSV lacks a metric raises ``ResultsError`` naming the file. The rows are in
``claims_dsa.py`` and ``claims_gefen.py``, what they share in ``claims_common.py``.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import re
import sys
from pathlib import Path

from analysis import book, claims_dsa, claims_gefen
from analysis.claims_common import Results, cmd
from analysis.common import DETAIL, ResultsError, load_config, read_section, write_section
from experiments.harness.common import REPO_ROOT, RESULTS_DIR

README = REPO_ROOT / "README.md"
BEGIN, END = "<!-- begin claims -->", "<!-- end claims -->"
ROWS = claims_dsa.ROWS + claims_gefen.ROWS

GLOSSARY = """Terms used in the table:

- **×**: times as fast as the baseline named (above 1: faster). **B/param**: bytes per parameter.
- **vs AdamW's loss**: the final validation loss over AdamW's of the same seed, as a percentage above it (below: better);
  every convergence and ablation row, figure and section gives the median over seeds.
- **the seed**: the Disk Sparse Adam article's own benchmark: a 1M × 128 Poincaré-ball embedding table, batch 2048.
- **fresh / warm / cold**: DSA's state file just created (fresh), in the page cache (warm), or its pages dropped so
  every step reads the disk (cold). **QD32**: the disk's random-read rate with 32 reads in flight.
- **both protocols**: the convergence runs' two ways of choosing the lr: each optimizer at its own best lr of a
  grid, and every optimizer at AdamW's best lr (**drop-in**: a user swapping AdamW out without tuning).
- **S1 / S2 / S3**: the Gefen article's Hessian statements: (S1) larger Hessian coupling goes with a steadier
  ratio of squared gradients; (S2) Gefen's blocks group coupled parameters better than random blocks of the same
  sizes; (S3) a shared v on Gefen's blocks trains as well as AdamW.
- **lean mode**: 8-bit factored Gefen on bf16 weights with stochastic rounding, its step inside backward.
- **factored / compact / published**: Gefen's `layout="factored"` and `"compact"` (ours) / `"published"` (the article's).
- **Verdicts**: *reproduced*: the article's claim holds here; *exceeded*: holds with a better figure; *holds*: a
  claim of this repository holds; *met / not met*: a stated target reached or not; *measured*: a figure with no
  target; *found here*: a result of this repository, not a claim of the articles."""


def setup_line(R) -> str:
    """Versions, devices and commits of the committed runs, from the CSVs and their configs."""
    def runs(pattern):
        out = []
        for path in sorted(R.dir.glob(pattern)):
            name = str(path.relative_to(R.dir))[:-4]
            rows = R.rows(name)
            out.append((rows[0], load_config(path.stem, path.parent)))
        return out

    def describe(items):
        torch = sorted({r["torch_version"] for r, _ in items})
        device = sorted({r["device"] for r, _ in items})
        ordered = sorted(items, key=lambda it: it[0]["timestamp"])
        commits = {r["git_commit"] for r, _ in items}
        # a run split into several experiments' files counts once
        walls = {(c.get("split_from") or {}).get("timestamp") or id(c): float(c.get("wall_seconds") or 0)
                 for _, c in items}
        wall = sum(walls.values())
        first, last = ordered[0][0]["git_commit"], ordered[-1][0]["git_commit"]
        where = f"commit {first}" if len(commits) == 1 else f"{len(commits)} commits, {first} (first run) .. {last} (last)"
        return f"torch {', '.join(torch)} on {', '.join(device)}, {where}", wall

    cpu, cpu_wall = describe(runs("*.csv"))
    gpu, gpu_wall = describe(runs("gpu/*.csv"))
    return (f"Setup: CPU rows: {cpu}; GPU rows: {gpu}. The full reproduction took {(cpu_wall + gpu_wall) / 3600:.1f} h "
            "of wall time (the runs' configs).")


def block(results_dir=RESULTS_DIR) -> str:
    """The Markdown between the claims markers."""
    R = Results(results_dir)
    cells = [f(R) for f in ROWS]
    lines = ["× = times as fast as the baseline named; every figure is read from the CSV named in its section "
             "of the [results book](results/README.md).", "", setup_line(R), "",
             "| claim | verdict | headline figure | figure | command |", "|---|---|---|---|---|"]
    lines += [f"| {r.claim} | **{r.verdict}** | {r.headline} | {r.figure} | {r.command} |" for r in cells]
    return "\n".join(lines + ["", GLOSSARY])


DETAIL_INTRO = ("Each row of the README's claims table with the conditions and caveats behind its headline, written by "
                "`python analysis/claims.py` from the same values as the table: every figure here is formatted from the "
                "CSVs and configs, and each entry names the runs it read and links the section with their full tables.")
DETAIL_SETUP = ("The CPU runs shared their machine with other jobs; weights are fp32 unless a row says otherwise. The GPU "
                "rows were measured once (`bash experiments/gpu_checks.sh`, `results/gpu/`); the \"Triton kernels\" "
                "section predicts from the kernels compiled ahead of time (`ptxas -v`, theoretical occupancy) and a "
                "traffic model.")
DETAIL_NOTES = ("**Gefen checkpoints under torch.distributed** (no row of the table). DCP needs shapes that do not depend "
                "on the blocks, so these checkpoints take several times the in-memory state's bytes on disk; loading into "
                "a different number of ranks works where every new shard is a whole number of the saved blocks, "
                "otherwise a `ValueError` names the parameter. `tests/test_gefen_distributed.py` checks on gloo ranks "
                "that DDP, FSDP2 and HSDP equal one process bit for bit and that DCP round trips and loads into fewer "
                "ranks continue bit for bit.")


def section_titles() -> dict:
    """{experiment: (section, title)} of every analysis script's ``REPORT`` (an experiment it reads
    beside its own, such as each ablation's, maps to its section too)."""
    import importlib
    import pkgutil

    import analysis

    out = {}
    for module in pkgutil.iter_modules(analysis.__path__):
        if module.name in ("claims", "common", "figure_check", "book"):
            continue
        mod = importlib.import_module(f"analysis.{module.name}")
        report = getattr(mod, "REPORT", None)
        if report is not None:
            for experiment in (report.experiment, *getattr(mod, "ABLATIONS", ())):
                out[experiment] = (report.name, report.title)
    return out


def seeds_text(seeds) -> str:
    """"seed 0", "seeds 0–2" (a run of integers) or "seeds 0, 3"."""
    seeds = sorted(seeds, key=lambda s: (len(str(s)), str(s)))
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    ints = [int(s) for s in seeds if str(s).isdigit()]
    if len(ints) == len(seeds) and ints == list(range(ints[0], ints[0] + len(ints))):
        return f"seeds {ints[0]}–{ints[-1]}"
    return "seeds " + ", ".join(map(str, seeds))


def run_text(R, experiment, titles) -> str:
    """Where a row's figures come from: the section (or CSV) of ``experiment``, its run's commit, seeds, command."""
    rows = R.rows(experiment)
    config = R.run(experiment)
    section, title = titles.get(experiment, (None, None))
    where = book.link(section, title) if title else f"[results/{experiment}.csv]({experiment}.csv)"
    facts = [f"commit `{config.get('git_commit') or rows[0]['git_commit']}`"]
    device = config.get("device") or rows[0]["device"]
    if not device.startswith("cpu"):
        facts.append(f"{device}, torch {config.get('torch_version') or rows[0]['torch_version']}")
    seeds = {r["seed"] for r in rows if r.get("seed") not in (None, "")}
    if seeds:
        facts.append(seeds_text(seeds))
    if config.get("command"):
        facts.append(cmd(config["command"]))
    return f"{where} ({', '.join(facts)})"


def rows_read(R) -> list:
    """[(row, [experiments it read])] of every claim row, in the table's order."""
    out = []
    for f in ROWS:
        R.read = []
        out.append((f(R), list(R.read)))
    return out


def detail(results_dir=RESULTS_DIR) -> str:
    """The section "Claims in detail" (results/claims.md): one paragraph a row of the table, after its setup."""
    R = Results(results_dir)
    titles = section_titles()
    parts = ["## Claims in detail", DETAIL_INTRO, f"{setup_line(R)} {DETAIL_SETUP}"]
    for row, read in rows_read(R):
        runs = "; ".join(run_text(R, e, titles) for e in read)
        parts.append(f"**{row.claim}** (*{row.verdict}*): {row.headline}." + (f" {row.detail}" if row.detail else "")
                     + f" From {runs}.")
    parts.append(DETAIL_NOTES)
    return book.wrapped("\n\n".join(parts))


INDEX_HEAD = """# Results

The results book: the claims' verdicts below, each topic's sections on a page of its own. Every page is
generated from the committed CSVs (`results/*.csv`, one clean run of one commit each): an analysis
script (`python analysis/NAME.py`) writes its section NAME on its page, `python analysis/claims.py`
writes this index, the claims' detail and the top-level README's claims table
(`python analysis/claims.py --check` fails when any of them differs from the results). How to use the
optimizers, every option and refusal: [docs/USAGE.md](../docs/USAGE.md).
"""


def index(results_dir=RESULTS_DIR) -> str:
    """results/README.md: its head, each claim's verdict with a link to the section of its first run, the pages."""
    R = Results(results_dir)
    titles = section_titles()
    lines = ["| claim | verdict | section |", "|---|---|---|"]
    for row, read in rows_read(R):
        section, title = next((titles[e] for e in read if e in titles), (None, None))
        where = book.link(section, title) if title else "[claims in detail](claims.md)"
        lines.append(f"| {row.claim} | **{row.verdict}** | {where} |")
    table = ("Each claim's headline figure, conditions and runs: [the claims in detail](claims.md).\n\n"
             + "\n".join(lines))
    return INDEX_HEAD + "\n" + book.index(table) + "\n"


def replace_block(doc: str, text: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(doc):
        raise ResultsError(f"README.md has no {BEGIN} ... {END} block; add the two markers where the table goes")
    return pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", doc, count=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--book", type=Path, default=None,
                        help="the folder of the results book's index (README.md) and claims page (claims.md) "
                             "(default: RESULTS_DIR)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the README's table, the claims page or the index is not what would be written")
    args = parser.parse_args(argv)
    folder = args.book or args.results_dir
    claims_page, index_page = folder / "claims.md", folder / "README.md"
    doc = args.readme.read_text()
    new = replace_block(doc, block(args.results_dir))
    text, index_text = detail(args.results_dir), index(args.results_dir)
    if args.check:
        stale = [str(p) for p, ok in ((args.readme, new == doc),
                                      (claims_page, claims_page.exists() and read_section(claims_page, DETAIL) == text),
                                      (index_page, index_page.exists() and index_page.read_text() == index_text))
                 if not ok]
        for path in stale:
            print(f"{path}: the claims differ from the results; run python analysis/claims.py")
        return 1 if stale else 0
    args.readme.write_text(new)
    write_section(claims_page, DETAIL, text, head=book.head("claims"))
    index_page.write_text(index_text)
    print(f"wrote the claims table of {args.readme}, {claims_page} and {index_page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
