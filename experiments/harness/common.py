"""What every experiment shares: command-line flags, where outputs go, the results CSV, W&B logging.

A run of an experiment writes ``results/<experiment>.csv`` (replacing the file: one CSV is one run
of one commit) with the columns of docs/DESIGN.md::

    experiment, variant, metric, unit, x_name, x_value, value, seed, device, torch_version,
    git_commit, timestamp

and ``results/<experiment>.config.json`` beside it: the resolved config, the commit, the device, the
torch version, the command line and the run's wall time. ``--quick`` runs write under
``results/quick/`` by default (their analysis draws beside them), ``--check`` runs (each script's
check size, experiments/harness/check.py) under ``results/check/``; both are refused a
``--results-dir`` that would write over the committed files.

Usage inside an experiment::

    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser, check=CHECK)  # --quick, --check, --wandb*, --results-dir, --seed
    args = check.parse(parser)            # --check: the script's CHECK flags, then the command line
    with Results("dsa_throughput", args, config=vars(args)) as res:
        res.add("seed/DiskSparseAdam/warm", "throughput", "samples/s", 1.2e5, x_name="config", x_value="seed")
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments.harness import tracking

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "results"
FIGS_DIR = REPO_ROOT / "paper_figs"

FIELDS = [
    "experiment", "variant", "metric", "unit", "x_name", "x_value", "value", "seed", "device",
    "torch_version", "git_commit", "timestamp",
]


def results_dir(quick: bool, check: bool = False) -> Path:
    """The default results folder: ``results/quick`` for --quick runs, ``results/check`` for --check
    runs, else ``results``."""
    return RESULTS_DIR / "quick" if quick else RESULTS_DIR / "check" if check else RESULTS_DIR


def output_dir(args) -> Path:
    """Where a run of ``args`` writes: ``args.results_dir`` if given, else ``results_dir`` of its size
    (``--tiny`` counts as quick)."""
    given = getattr(args, "results_dir", None)
    quick = bool(getattr(args, "quick", False) or getattr(args, "tiny", False))
    return Path(given) if given else results_dir(quick, bool(getattr(args, "check", False)))


def same_file_under(path, folder, outside=None) -> bool:
    """Whether ``path`` is an existing file that is also a file under ``folder`` (and not under
    ``outside``), compared by identity (device and inode): a hard link or a symbolic link to it, under
    any name, is the same file, and a write to it rewrites that one in place."""
    if not Path(path).is_file():
        return False
    target = os.stat(path)
    skip = Path(outside).resolve() if outside else None
    return any(os.path.samestat(target, f.stat()) for f in Path(folder).resolve().rglob("*")
               if f.is_file() and not (skip and f.resolve().is_relative_to(skip)))


RUN_KINDS = {  # the runs that never write the committed results: their own folder under results/, and why
    "quick": "a quick run is a smoke test",
    "check": "a check run tests a claim at a smaller size than the committed run's",
}


def refuse_committed_outputs(folder, names=(), kind: str = "quick") -> None:
    """Refuse a quick (or check) run's outputs on the committed results: ``folder`` inside ``results/``
    but outside ``results/<kind>``, however it is spelled (``..``, a symlink), or a file ``names`` of
    ``folder`` that is a committed one under another name (a hard or symbolic link)."""
    where, committed, own = Path(folder).resolve(), RESULTS_DIR.resolve(), (RESULTS_DIR / kind).resolve()
    why = (f"{RUN_KINDS[kind]} and never writes the committed results; leave out --results-dir "
           f"(it writes results/{kind}) or name a folder of its own")
    if where.is_relative_to(committed) and not where.is_relative_to(own):
        raise ValueError(f"--results-dir {folder}: it is {where}, in the committed results/; {why}")
    for name in names:
        if same_file_under(where / name, committed, outside=own):
            raise ValueError(f"--results-dir {folder}: its {name} is a file of the committed results/ (a link to "
                             f"it); {why}")


def add_common_args(parser, default_seed: int = 0, check=None, check_note: str = ""):
    """Flags every experiment takes. ``check``: the script's check size, the full run's flags it
    overrides ({"--steps": 100, ...}, or a function of the parsed arguments returning them), which
    ``check.parse`` applies for ``--check``; ``check_note``: what that size can and cannot decide of
    the claim, printed with its verdict."""
    from experiments.harness.check import describe

    parser.add_argument("--quick", action="store_true",
                        help="small sizes; outputs go to results/quick (unless --results-dir)")
    parser.add_argument("--check", action="store_true",
                        help="the size that tests the claim in minutes (" + describe(check) + "); outputs go to "
                             "results/check (unless --results-dir), and the claims' verdicts on them are printed "
                             "beside the committed run's")
    parser.check_size = (check if check is not None else {}, check_note)
    tracking.add_args(parser)  # --wandb, --wandb-project, --wandb-entity, --wandb-dir
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where the CSV goes (default: results, or results/quick with --quick, results/check "
                             "with --check)")
    parser.add_argument("--seed", type=int, default=default_seed)
    return parser


def git_commit() -> str:
    """Short HEAD hash, with "+dirty" when tracked files outside results/ and paper_figs/ differ."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
        sha = out.stdout.strip()
        if not sha:
            return "unknown"
        # Outputs do not make the code dirty: a second experiment of one run is still of this commit.
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
             ":(exclude)results", ":(exclude)paper_figs"], cwd=REPO_ROOT,
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device=None) -> str:
    """A short human name of the device a measurement ran on ("cpu:<model> (<core>) xN" or the CUDA
    name). The core is LLVM's name for the CPU ("znver3", "znver4"): a model name such as "AMD EPYC"
    covers CPUs whose vector units differ, and with them torch's kernels, numba's and the results'
    last bits."""
    import torch

    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        return "cuda:" + torch.cuda.get_device_name(torch.device(device))
    model = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = "cpu:" + line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import llvmlite.binding

        model += f" ({llvmlite.binding.get_host_cpu_name()})"
    except (ImportError, RuntimeError):
        pass
    return f"{model} x{os.cpu_count()}"


class Results:
    """Collects the rows of one experiment run, writes its CSV and config, and keeps its W&B runs.

    Every ``flush()`` (and the context's exit, also on an exception, so a run that fails late keeps
    what it measured) rewrites the CSV with all rows of this run. The output folder is
    ``args.results_dir`` if given, else ``results/quick`` for ``args.quick``, ``results/check`` for
    ``args.check``, else ``results``; a quick (or tiny) or check run is refused one that would write over
    the committed results, and a check run prints the claims' verdicts on its CSV at its exit.

    W&B (experiments/harness/tracking.py): ``self.tracking`` is the experiment's W&B settings, for training
    runs of its configurations (``self.tracking.train_run(...)``, in this or a worker process). The
    experiment's results run gets each row as ``add`` makes it, unless ``wandb_rows=False`` (for
    experiments whose training runs log their curves), and at the exit the CSV and config.json as an
    artifact. config.json records the versions of torch and the peers and where the W&B runs went.
    """

    def __init__(self, experiment: str, args=None, config: dict | None = None, device=None, wandb_rows: bool = True):
        import torch

        self.experiment = experiment
        quick = bool(getattr(args, "quick", False) or getattr(args, "tiny", False))
        self.check = bool(getattr(args, "check", False)) and not quick
        self.check_note = getattr(args, "check_note", "")
        self.results_dir = output_dir(args)
        if quick or self.check:
            refuse_committed_outputs(self.results_dir, [f"{experiment}.csv", f"{experiment}.config.json"],
                                     "quick" if quick else "check")
        self.seed = getattr(args, "seed", "")
        self.device = device_name(device)
        self.torch_version = torch.__version__
        self.commit = git_commit()
        self.config = _jsonable(config or {})
        self.command = _command()
        # One timestamp per run (its start): rows of one run carry the same one.
        self.timestamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self._start = time.perf_counter()
        self.rows: list[dict] = []
        self.versions = tracking.versions()
        env = {"git_commit": self.commit, "device": self.device, "command": self.command, "versions": self.versions}
        self.tracking = tracking.Tracking.from_args(experiment, args, root=REPO_ROOT, env=env, config=self.config)
        self._wandb_rows = wandb_rows
        self._run = self.tracking.results_run()

    @property
    def path(self) -> Path:
        return self.results_dir / f"{self.experiment}.csv"

    @property
    def config_path(self) -> Path:
        return self.results_dir / f"{self.experiment}.config.json"

    def add(self, variant, metric, unit, value, x_name="", x_value="", seed=None):
        row = {
            "experiment": self.experiment, "variant": variant, "metric": metric, "unit": unit,
            "x_name": x_name, "x_value": x_value, "value": float(value),
            "seed": self.seed if seed is None else seed, "device": self.device,
            "torch_version": self.torch_version, "git_commit": self.commit,
            "timestamp": self.timestamp,
        }
        self.rows.append(row)
        if self._wandb_rows:
            self._run.row(row, self.seed)
        return row

    @property
    def wall_seconds(self) -> float:
        return time.perf_counter() - self._start

    def flush(self):
        self.results_dir.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(self.rows)
        meta = {"config": self.config, "git_commit": self.commit, "device": self.device,
                "torch_version": self.torch_version, "command": self.command,
                "wall_seconds": round(self.wall_seconds, 1), "timestamp": self.timestamp,
                "versions": self.versions, "wandb": self.tracking.record(self._run, REPO_ROOT)}
        self.config_path.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.flush()
        self._run.summary({"rows": len(self.rows), "wall_seconds": self.wall_seconds})
        self._run.artifact(f"{self.experiment}-results", "results", [self.path, self.config_path])
        self._run.finish()
        print(f"[{self.experiment}] {len(self.rows)} rows in {self.path}; wall time {self.wall_seconds:.1f} s",
              flush=True)
        if self.check and exc[0] is None:
            from experiments.harness.check import report

            print(report(self.experiment, self.results_dir, self.check_note), flush=True)
        return False


def add_kind_rows(res: Results, variant: str, kinds: dict, n_params: int, seed=None) -> dict:
    """The rows of one ``registry.state_bytes_by_kind`` result: ``state_bytes_per_param_of_kind``
    (a kind's bytes over its parameters; "shared" over the model's ``n_params``) and
    ``params_of_kind`` against ``kind``. Returns {kind: bytes per parameter}."""
    out = {}
    for kind, (nbytes, count) in kinds.items():
        out[kind] = nbytes / (count or n_params)
        res.add(variant, "state_bytes_per_param_of_kind", "B/param", out[kind], x_name="kind", x_value=kind, seed=seed)
        res.add(variant, "params_of_kind", "count", count, x_name="kind", x_value=kind, seed=seed)
    return out


def _command() -> str:
    """``sys.argv`` joined, with paths inside the repository made relative to it."""
    def rel(arg):
        p = Path(arg)
        return str(p.relative_to(REPO_ROOT)) if p.is_absolute() and p.is_relative_to(REPO_ROOT) else arg

    return " ".join(["python"] + [rel(a) for a in sys.argv])


def _jsonable(config: dict) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in config.items()}


def read_results(name_or_path, results_dir: Path | None = None):
    """Read one results CSV into a list of dicts with ``value`` and numeric ``x_value`` as floats."""
    p = Path(name_or_path)
    if not p.suffix:
        p = Path(results_dir or RESULTS_DIR) / f"{name_or_path}.csv"
    if not p.exists():
        raise FileNotFoundError(f"{p}: no results yet; run the experiment that writes it first")
    with open(p, newline="") as f:
        rows = list(csv.DictReader(f))
    missing = set(FIELDS) - set(rows[0].keys()) if rows else set()
    if missing:
        raise ValueError(f"{p}: not a results file of docs/DESIGN.md's format, missing columns {sorted(missing)}")
    for r in rows:
        r["value"] = float(r["value"])
        try:
            r["x_value"] = float(r["x_value"])
        except (TypeError, ValueError):
            pass
    return rows
