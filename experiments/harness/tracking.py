"""Weights & Biases runs of the experiments, as a researcher compares them.

What an experiment writes (offline unless ``--wandb online``; ``wandb sync <dir>/wandb/offline-run-*``
uploads offline runs later):

- one **training run** per trained configuration (experiment, model, optimizer, lr, seed), job type
  "train", named ``<experiment>/<model>/<optimizer>/lr<lr>/s<seed>``, grouped by experiment, tagged
  (experiment, optimizer, "quick", "check" or "full"), its config the experiment's config, the
  configuration's hyper-parameters and ``environment()`` (commit, device, versions of torch and the
  peers). Its history holds numbers only, logged live at the experiment's logging interval against
  ``train/step``; its summary is set explicitly at the end (``final/*``, ``best/*``, ``mean/*``),
  never "the last logged value";
- one **results run** per experiment (job type "results", ``<experiment>/results``, the same group):
  a benchmark's rows (``Results.add``) against their x value where it is a number, and at the end
  the CSV and config.json as an artifact of type "results";
- the **figure**: ``analysis/common.py`` logs it as an image in a new run of the same group (job
  type "figure"), with the mode, project and directory the experiment recorded in its config.json.
  A new run rather than resuming the results run: offline runs cannot be resumed.

W&B never costs a measurement: every call goes through ``_guard``, and a failure prints one warning
and turns that run into a no-op. With mode "disabled" nothing of wandb is imported. Runs are
finished one after another in one process (one W&B service per process), so a run costs little.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import numbers
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

PROJECT = "memory-light-optimizers"
MODES = ("offline", "online", "disabled")
STEP = "train/step"
# distributions whose versions every run records (absent ones are left out); gefen-x lives in
# third_party/ and is read by registry.gefen_x_version
PEERS = ("torch", "gefen", "torchao", "adam-mini", "geoopt", "numba", "triton", "wandb", "deepspeed", "bitsandbytes")
_MODE_ALIASES = {"dryrun": "offline", "run": "online"}


def resolve_mode(flag: str | None) -> str:
    """The W&B mode: ``--wandb``, else $WANDB_MODE, else "offline"."""
    mode = flag or os.environ.get("WANDB_MODE") or "offline"
    mode = _MODE_ALIASES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"W&B mode {mode!r} (from --wandb or $WANDB_MODE): choose one of {MODES}")
    return mode


def add_args(parser):
    """The ``--wandb*`` flags (experiments.harness.common.add_common_args adds them to every experiment)."""
    parser.add_argument("--wandb", choices=MODES, default=None,
                        help="Weights & Biases mode (default: $WANDB_MODE, else offline; "
                             "`wandb sync wandb/offline-run-*` uploads offline runs later)")
    parser.add_argument("--wandb-project", default=PROJECT, help=f"W&B project (default: {PROJECT})")
    parser.add_argument("--wandb-entity", default=None, help="W&B entity: user or team (default: yours)")
    parser.add_argument("--wandb-dir", type=Path, default=None,
                        help="folder that gets wandb/ (default: this checkout's root, where git ignores it)")
    return parser


def versions() -> dict:
    """{distribution: version} of torch, the peers and wandb that are installed, and gefen-x's."""
    out = {"python": sys.version.split()[0]}
    for name in PEERS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        from experiments.harness.registry import gefen_x_version

        if gefen_x_version():
            out["gefen-x"] = gefen_x_version()
    except Exception:  # a registry that cannot load must not stop the run's records
        pass
    return out


def numbers_only(metrics: dict) -> dict:
    """The entries of ``metrics`` that are finite or non-finite real numbers, as floats or ints
    (bools and one-element tensors included); strings and everything else are left out: a
    history holds numbers, strings belong in config or summary."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, numbers.Integral):
            out[key] = int(value)
        elif isinstance(value, numbers.Real):
            out[key] = float(value)
    return out


def run_name(experiment: str, model: str, optimizer: str, lr: float, seed: int) -> str:
    """``<experiment>/<model>/<optimizer>/lr<lr>/s<seed>``."""
    return f"{experiment}/{model}/{optimizer}/lr{lr:g}/s{seed}"


def row_entry(row: dict, run_seed) -> tuple[str, dict, str | None]:
    """How one results row goes to the results run: (key, data, x_name). The key is
    ``<variant>/<metric>``, with ``/seed<seed>`` for a seed other than the run's. A numeric x value
    makes a history row ``{key: value, x_name: x}`` plotted against ``x_name``; any other row (no x,
    or a string x, appended to the key as ``/<x_name>=<x>``) is a summary entry (x_name None)."""
    key = f"{row['variant']}/{row['metric']}"
    if str(row.get("seed", "")) != str(run_seed):
        key += f"/seed{row['seed']}"
    x_name, x = row.get("x_name") or "", row.get("x_value", "")
    try:
        x = float(x)
    except (TypeError, ValueError):
        x = None
    if x_name and x is not None:
        return key, {key: float(row["value"]), x_name: x}, x_name
    if x_name:
        key += f"/{x_name}={row['x_value']}"
    return key, {key: float(row["value"])}, None


def curve_summary(val, train=(), step_times=(), extra: dict | None = None) -> dict:
    """A training run's summary from its curves ([(step, loss)]) and step times (seconds): the
    final and best validation loss and the best one's step, the final training loss, the mean and
    median step time in ms; ``extra`` added as given. Non-finite losses count as diverged."""
    out = {}
    if val:
        finite = [(s, v) for s, v in val if math.isfinite(v)]
        out["final/val_loss"] = val[-1][1]
        out["final/step"] = val[-1][0]
        out["diverged"] = int(len(finite) < len(val))
        if finite:
            step, best = min(finite, key=lambda sv: sv[1])
            out.update({"best/val_loss": best, "best/val_loss_step": step})
    if train:
        out["final/train_loss"] = train[-1][1]
    if step_times:
        times = sorted(step_times)
        out["mean/step_time_ms"] = 1e3 * sum(times) / len(times)
        out["median/step_time_ms"] = 1e3 * times[len(times) // 2]
    out.update(extra or {})
    return out


def live_logger(run, once=None):
    """``train_lm``'s ``on_eval``: log each interval's metrics to ``run`` at their ``train/step``,
    the first time with the entries of ``once()`` added (numbers fixed after the first step, such as
    the optimizer's state bytes). None when ``run`` logs nothing, so nothing is computed for it."""
    if not run:
        return None
    pending = [once] if once is not None else []

    def log(metrics):
        metrics = dict(metrics)
        while pending:
            metrics.update(pending.pop()())
        run.log(metrics, step=metrics.pop(STEP, None))
    return log


class Run:
    """One W&B run, or nothing: every method is a no-op when W&B is disabled or has failed."""

    def __init__(self, run=None, label=""):
        self._run, self.label, self._keys = run, label, set()

    def __bool__(self):
        return self._run is not None

    @property
    def id(self) -> str | None:
        return self._run.id if self._run is not None else None

    def _guard(self, what, fn, *args, **kw):
        if self._run is None:
            return None
        try:
            return fn(*args, **kw)
        except Exception as exc:  # W&B must never cost a measurement
            print(f"[{self.label}] W&B {what} failed, this run logs nothing more: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            self._run = None
            return None

    def log(self, metrics: dict, step: int | None = None):
        """Log the numbers of ``metrics`` (``numbers_only``) as one history row, at ``train/step`` =
        ``step`` where given."""
        data = numbers_only(metrics)
        if step is not None:
            data[STEP] = int(step)
        if data:
            self._guard("log", self._run_log, data)

    def _run_log(self, data):
        self._run.log(data)

    def row(self, row: dict, run_seed):
        """One results row (``row_entry``): a history row against its x value, or a summary entry."""
        if self._run is None:
            return
        key, data, x_name = row_entry(row, run_seed)
        if x_name is None:
            self.summary(data)
            return
        if (key, x_name) not in self._keys:
            self._keys.add((key, x_name))
            self._guard("define_metric", lambda: (self._run.define_metric(x_name, summary="none"),
                                                   self._run.define_metric(key, step_metric=x_name, summary="none")))
        self._guard("log", self._run_log, data)

    def summary(self, values: dict):
        """Set summary entries (numbers or strings) explicitly."""
        self._guard("summary", lambda: self._run.summary.update(
            {k: (v.item() if hasattr(v, "item") else v) for k, v in values.items()}))

    def artifact(self, name: str, kind: str, paths):
        """Attach the files ``paths`` (those that exist) as one artifact."""
        def attach():
            import wandb

            art = wandb.Artifact(name, type=kind)
            for p in paths:
                if Path(p).exists():
                    art.add_file(str(p))
            self._run.log_artifact(art)
        self._guard("artifact", attach)

    def image(self, key: str, path):
        """Log the image file ``path`` under ``key``."""
        def log():
            import wandb

            self._run.log({key: wandb.Image(str(path))})
        self._guard("image", log)

    def finish(self):
        self._guard("finish", self._run.finish if self._run is not None else None)
        self._run = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finish()
        return False


@dataclass(frozen=True)
class Tracking:
    """Where and how an experiment's runs go; plain data, so it travels to worker processes.

    ``env``: every run's environment entries (commit, device, versions); ``config``: the
    experiment's resolved config, the base of every run's config."""

    experiment: str
    mode: str = "disabled"
    project: str = PROJECT
    entity: str | None = None
    dir: str = ""
    quick: bool = False
    env: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    check: bool = False  # a --check run (experiments/harness/check.py)

    @classmethod
    def from_args(cls, experiment: str, args, *, root: Path, env: dict, config: dict) -> "Tracking":
        try:
            mode = resolve_mode(getattr(args, "wandb", None))
        except ValueError as exc:
            print(f"[{experiment}] W&B off: {exc}", file=sys.stderr)
            mode = "disabled"
        given = getattr(args, "wandb_dir", None)
        return cls(experiment, mode, getattr(args, "wandb_project", None) or PROJECT,
                   getattr(args, "wandb_entity", None), str(Path(given) if given else root),
                   bool(getattr(args, "quick", False) or getattr(args, "tiny", False)), dict(env), dict(config),
                   check=bool(getattr(args, "check", False)))

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"

    @property
    def scale(self) -> str:
        return "quick" if self.quick else "check" if self.check else "full"

    def for_experiment(self, experiment: str) -> "Tracking":
        return replace(self, experiment=experiment)

    def start(self, name: str, job_type: str, tags=(), config: dict | None = None) -> Run:
        """A new run of this experiment's group (a no-op ``Run`` when disabled or W&B fails)."""
        if not self.enabled:
            return Run(None, name)
        try:
            wandb = _wandb()
            Path(self.dir).mkdir(parents=True, exist_ok=True)
            full = {**self.config, **(config or {}), "experiment": self.experiment, "scale": self.scale,
                    **self.env}
            run = wandb.init(
                project=self.project, entity=self.entity, mode=self.mode, dir=self.dir, name=name,
                group=self.experiment, job_type=job_type,
                tags=list(dict.fromkeys([self.experiment, self.scale, *tags])), config=full,
                reinit="create_new", settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            )
        except Exception as exc:  # W&B must never cost a measurement
            print(f"[{name}] W&B run not started, logging nothing: {type(exc).__name__}: {exc}", file=sys.stderr)
            return Run(None, name)
        return Run(run, name)

    def train_run(self, *, model: str, optimizer: str, lr: float, seed: int, config: dict | None = None) -> Run:
        """The run of one trained configuration; its history is plotted against ``train/step``."""
        run = self.start(run_name(self.experiment, model, optimizer, lr, seed), "train", tags=(optimizer,),
                         config=dict(config or {}, model_label=model, optimizer=optimizer, lr=lr, seed=seed))
        run._guard("define_metric", lambda: (run._run.define_metric(STEP, summary="none"),
                                             run._run.define_metric("*", step_metric=STEP, summary="none")))
        return run

    def results_run(self) -> Run:
        """The experiment's results run (benchmark rows, the CSV artifact)."""
        return self.start(f"{self.experiment}/results", "results")

    def record(self, results_run: Run | None = None, root: Path | None = None) -> dict:
        """What config.json keeps so that the analysis can log the figure to the same place; ``dir``
        relative to ``root`` (the checkout) where it lies inside it."""
        where = Path(self.dir)
        if root is not None and where.resolve().is_relative_to(Path(root).resolve()):
            where = where.resolve().relative_to(Path(root).resolve())
        return {"mode": self.mode, "project": self.project, "entity": self.entity, "dir": where.as_posix(),
                "group": self.experiment, "results_run_id": results_run.id if results_run else None}


@functools.lru_cache(maxsize=None)
def _wandb():
    import wandb

    return wandb


def log_figure(config: dict, path, name: str, root: Path | None = None):
    """Log the figure ``path`` as an image in a new run (job type "figure") of the group that the
    results' config.json (``config``, as analysis.common.load_config reads it) recorded under
    "wandb"; nothing when it recorded none, it was disabled, or $WANDB_MODE is "disabled".

    The run goes into the recorded folder: a relative one (the experiment's checkout) inside ``root``,
    the analysing checkout; an absolute one (given with ``--wandb-dir``) as it is."""
    rec = config.get("wandb") or {}
    if not rec or rec.get("mode", "disabled") == "disabled" or os.environ.get("WANDB_MODE") == "disabled":
        return
    where = Path(root or ".") / rec.get("dir", ".")
    tracking = Tracking(rec.get("group") or name, rec["mode"], rec.get("project") or PROJECT, rec.get("entity"),
                        str(where), env={"figure": name, "results_run_id": rec.get("results_run_id")})
    with tracking.start(f"{tracking.experiment}/figure/{name}", "figure") as run:
        run.image(f"figure/{name}", path)
