"""Fault injection: SIGKILL or SIGINT a DiskSparseAdam training process at random points, then check recovery.

    python experiments/dsa_fault_injection.py              # 200 trials; rows into results/
    python experiments/dsa_fault_injection.py --quick      # 10 trials; rows into results/quick/
    python experiments/dsa_fault_injection.py --trials 50

Each trial is one process that restores a checkpoint into a fresh state_dir, trains a small table
(duplicate indices in every batch) and checkpoints every few steps the documented way: torch.save of
model and optimizer state dicts (to a temporary name, then renamed), then ``opt.flush()``. Before
each phase (restore, create, load, step, save, flush, close) it writes the phase to a status file. The
parent waits for a randomly chosen event of a target phase (targets cycle through the phases), waits
a random 0-2 ms more, and sends the process SIGKILL or SIGINT (alternating). SIGINT is Ctrl-C: a
KeyboardInterrupt wherever the process is, which the optimizer's ``with`` block closes on (a step or
load it cuts short must leave the files dirty); the script then saves its model weights at the step
it reached, as a script that catches Ctrl-C does, and exits. Then the parent reopens the state_dir
with ``resume=True``:

- refused with StateFileError: restore the newest checkpoint into a new state_dir and train on;
- accepted: load the model weights saved at the step the files hold (a checkpoint, or the weights
  saved on Ctrl-C) and train on.

Either way the weights at the last step must equal, bitwise, an uninterrupted torch.optim.SparseAdam
run. Anything else fails the trial: accepted state that continues differently, no checkpoint at the
accepted step, a checkpoint that does not load, an error other than StateFileError, a hang.

Trial processes are forked by one warm server process (imports and kernels loaded once), so a trial
costs its training, not an interpreter start. Rows (results/dsa_fault_injection.csv): variant
"DiskSparseAdam/SIGKILL" or "DiskSparseAdam/SIGINT" (and "DiskSparseAdam" for both), x_name "phase"
(the phase the process reported last; "done" if it finished before the signal, "all" for totals),
metrics ``trials``, ``refused_dirty``, ``accepted_clean``, ``bitwise_continuations``, ``failures``;
and ``wall_time`` (s) of all trials.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import copy
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from experiments.harness.child import child_env
from experiments.harness import check
from experiments.harness.common import REPO_ROOT, Results, add_common_args

ROWS, DIM, BATCH, HOT = 2000, 16, 512, 200
LR, START, TOTAL, EVERY = 1e-2, 5, 40, 5
PHASES = ["restore", "create", "load", "step", "save", "flush"]
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGINT": signal.SIGINT}
STATUS_BYTES = 48


# ------------------------------------------------------------------------- the training problem
# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {}
CHECK_NOTE = ("the full run's size (200 SIGKILL and SIGINT trials): the claim itself")


def batch(step: int, seed: int):
    """Indices (heavy duplicates: BATCH draws from HOT rows) and targets of one step."""
    hot = torch.randperm(ROWS, generator=torch.Generator().manual_seed(seed))[:HOT]
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return hot[torch.randint(0, HOT, (BATCH,), generator=g)], torch.randn(BATCH, DIM, generator=g)


def model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Embedding(ROWS, DIM, sparse=True)


def train(emb, opt, start: int, stop: int, seed: int, report=None, save=None):
    """Steps start+1..stop; with ``save``, checkpoint after every EVERY-th step."""
    for t in range(start + 1, stop + 1):
        if report:
            report("step", t)
        idx, target = batch(t, seed)
        opt.zero_grad()
        ((emb(idx) - target) ** 2).mean().backward()
        opt.step()
        if save and t % EVERY == 0:
            save(t)


def events():
    """The (phase, step) sequence a trial process reports; index + 1 is its sequence number."""
    seq = [("restore", START), ("create", START), ("load", START)]
    for t in range(START + 1, TOTAL + 1):
        seq.append(("step", t))
        if t % EVERY == 0:
            seq += [("save", t), ("flush", t)]
    return seq + [("close", TOTAL)]


def ckpt_path(trial_dir, step: int) -> Path:
    return Path(trial_dir) / f"ckpt-{step:06d}.pt"


def weights_path(trial_dir, step: int) -> Path:
    """The model weights a script saves when Ctrl-C stops it at ``step``."""
    return Path(trial_dir) / f"weights-{step:06d}.pt"


# ------------------------------------------------------------------------------ the trial process
def trial(trial_dir: str, seed: int):
    """Restore the START checkpoint into a fresh state_dir, train to TOTAL, checkpointing; report phases."""
    from optim import DiskSparseAdam

    status = os.open(os.path.join(trial_dir, "status"), os.O_WRONLY)
    n = [0]

    def report(phase, step):
        n[0] += 1
        os.pwrite(status, f"{n[0]} {phase} {step}".ljust(STATUS_BYTES).encode(), 0)

    def save(t):
        report("save", t)
        path = ckpt_path(trial_dir, t)
        torch.save({"model": emb.state_dict(), "opt": opt.state_dict(), "step": t}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
        report("flush", t)
        opt.flush()

    report("restore", START)
    ckpt = torch.load(ckpt_path(trial_dir, START))
    emb = model(seed + 1)
    emb.load_state_dict(ckpt["model"])
    report("create", START)
    opt = None
    try:
        with DiskSparseAdam(emb.parameters(), lr=LR, state_dir=os.path.join(trial_dir, "state")) as opt:
            report("load", START)
            opt.load_state_dict(ckpt["opt"])
            train(emb, opt, START, TOTAL, seed, report, save)
            report("close", TOTAL)
    except KeyboardInterrupt:  # Ctrl-C: the optimizer closed on the way out; keep the weights too
        if opt is not None:
            torch.save({"model": emb.state_dict()}, weights_path(trial_dir, opt.step_count(emb.weight)))
        raise
    report("done", TOTAL)


def server(seed: int):
    """Warm once, then fork one trial process per trial directory read from stdin.

    For each it prints the child's pid, then its wait status once it ends (killed or done).
    """
    torch.set_num_threads(1)  # no intra-op thread pool to be copied, half-alive, into the children
    from optim import DiskSparseAdam

    with tempfile.TemporaryDirectory() as warm:  # load the kernels before forking
        emb = model(seed)
        with DiskSparseAdam(emb.parameters(), lr=LR, state_dir=warm) as opt:
            train(emb, opt, 0, 2, seed)
    print("ready", flush=True)
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                trial(line.strip(), seed)
                code = 0
            except KeyboardInterrupt:
                code = 130  # as a shell reports Ctrl-C
            finally:
                os._exit(code)
        print(pid, flush=True)
        print(os.waitpid(pid, 0)[1], flush=True)


# ---------------------------------------------------------------------------------- the parent
def reference(seed: int):
    """Uninterrupted torch.optim.SparseAdam: the START checkpoint and the final weights."""
    emb = model(seed)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=LR)
    init = {"model": {k: v.clone() for k, v in emb.state_dict().items()}, "step": 0}
    train(emb, opt, 0, START, seed)
    ckpts = {0: init, START: copy.deepcopy({"model": emb.state_dict(), "opt": opt.state_dict(), "step": START})}
    train(emb, opt, START, TOTAL, seed)
    return ckpts, emb.weight.detach().clone()


def run_one(srv, trial_dir: Path, target_seq: int, delay: float, ckpts, sig=signal.SIGKILL):
    """Start one trial process, signal it at ``target_seq`` + ``delay``; return the phase it last reported."""
    for step, c in ckpts.items():
        torch.save(c, ckpt_path(trial_dir, step))
    (trial_dir / "status").write_bytes(b"0 start 0".ljust(STATUS_BYTES))
    srv.stdin.write(f"{trial_dir}\n")
    srv.stdin.flush()
    pid = int(srv.stdout.readline())
    fd = os.open(trial_dir / "status", os.O_RDONLY)
    try:
        deadline = time.monotonic() + 60
        while int(os.pread(fd, STATUS_BYTES, 0).split()[0]) < target_seq and time.monotonic() < deadline:
            time.sleep(0.0001)
        end = time.monotonic() + delay
        while time.monotonic() < end:
            pass
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        status = int(srv.stdout.readline())
        phase = os.pread(fd, STATUS_BYTES, 0).split()[1].decode()
    finally:
        os.close(fd)
    interrupted = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 130
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) not in (0, 130):
        return "crashed"
    return phase if os.WIFSIGNALED(status) or interrupted or phase == "done" else "unresolved"


def _load_checkpoints(trial_dir: Path):
    """Every checkpoint under its final name, by step; a torn one raises (it must never be there).
    Weights saved on Ctrl-C count as a checkpoint of the model only."""
    found = {int(p.stem.split("-")[1]): torch.load(p) for p in sorted(trial_dir.glob("weights-*.pt"))}
    found.update({int(p.stem.split("-")[1]): torch.load(p) for p in sorted(trial_dir.glob("ckpt-*.pt"))})
    return found


def verify(trial_dir: Path, final, seed: int):
    """Reopen the killed process's state_dir and continue; (outcome, continued bitwise equal)."""
    from optim import DiskSparseAdam
    from optim.disk_sparse.store import StateFileError

    try:
        ckpts = _load_checkpoints(trial_dir)
    except Exception:  # noqa: BLE001  (any error loading a checkpoint is a failed trial)
        return "torn_checkpoint", False
    emb = model(seed + 2)
    opt = None
    # A resume takes only the weights its files were flushed with: offer each checkpoint's, newest first.
    for step in sorted(ckpts, reverse=True):
        emb.load_state_dict(ckpts[step]["model"])
        try:
            opt = DiskSparseAdam(emb.parameters(), lr=LR, state_dir=trial_dir / "state", resume=True)
            break
        except StateFileError:
            continue
        except Exception:  # noqa: BLE001  (an error other than StateFileError is a failed trial)
            return "crash", False
    if opt is None:
        step = max(k for k, c in ckpts.items() if "opt" in c or k == 0)
        emb.load_state_dict(ckpts[step]["model"])
        opt = DiskSparseAdam(emb.parameters(), lr=LR, state_dir=trial_dir / "restored")
        if "opt" in ckpts[step]:
            opt.load_state_dict(ckpts[step]["opt"])
        outcome = "refused_dirty"
    else:
        # files that never stepped record no weights and take any: continue from their step's checkpoint
        step = opt.step_count(emb.weight)
        if step not in ckpts:
            opt.close()
            return "accepted_without_checkpoint", False
        emb.load_state_dict(ckpts[step]["model"])
        outcome = "accepted_clean"
    with opt:
        train(emb, opt, step, TOTAL, seed)
    return outcome, torch.equal(emb.weight.detach(), final)


def start_server(seed: int):
    env = child_env()
    srv = subprocess.Popen([sys.executable, "-m", "experiments.dsa_fault_injection", "--server", "--seed", str(seed)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    if srv.stdout.readline().strip() != "ready":
        raise RuntimeError("fault-injection server did not start")
    return srv


def run_trials(n: int, seed: int, log=print):
    """n trials; per phase, a Counter of outcomes ("trials", outcome names, "bitwise", "failures")."""
    rng = random.Random(seed)
    seq = events()
    ckpts, final = reference(seed)
    counts: dict[str, Counter] = {}
    srv = start_server(seed)
    try:
        with tempfile.TemporaryDirectory(prefix="dsa-fi-") as root:
            for i in range(n):
                sig = list(SIGNALS)[i % len(SIGNALS)]  # each phase gets both signals in turn
                target = PHASES[(i // len(SIGNALS)) % len(PHASES)]
                target_seq = 1 + rng.choice([k for k, (ph, _) in enumerate(seq) if ph == target])
                trial_dir = Path(root) / f"t{i:04d}"
                trial_dir.mkdir()
                phase = run_one(srv, trial_dir, target_seq, rng.uniform(0, 0.002), ckpts, SIGNALS[sig])
                outcome, same = verify(trial_dir, final, seed) if phase not in ("crashed", "unresolved") \
                    else (phase, False)
                c = counts.setdefault((sig, phase), Counter())
                c.update({"trials": 1, outcome: 1, "bitwise": int(same), "failures": int(not same)})
                if not same:
                    log(f"trial {i}: {sig} in {phase}, {outcome}, continuation differs from the reference")
    finally:
        srv.stdin.close()
        srv.wait(timeout=30)
    return counts


def record(res: Results, counts, wall: float):
    """Rows per signal and phase, per signal for all phases, and for both signals ("DiskSparseAdam")."""
    metrics = [("trials", "trials"), ("refused_dirty", "refused_dirty"), ("accepted_clean", "accepted_clean"),
               ("bitwise_continuations", "bitwise"), ("failures", "failures")]
    order = [*PHASES, "close", "done"]
    total = Counter()
    for sig in SIGNALS:
        phases = {ph: c for (s, ph), c in counts.items() if s == sig}
        per_signal = Counter()
        for phase in [*order, *sorted(set(phases) - set(order))]:
            if phase in phases:
                per_signal.update(phases[phase])
                for metric, key in metrics:
                    res.add(f"DiskSparseAdam/{sig}", metric, "count", phases[phase][key], x_name="phase",
                            x_value=phase)
        for metric, key in metrics:
            res.add(f"DiskSparseAdam/{sig}", metric, "count", per_signal[key], x_name="phase", x_value="all")
        total.update(per_signal)
    for metric, key in metrics:
        res.add("DiskSparseAdam", metric, "count", total[key], x_name="phase", x_value="all")
    res.add("DiskSparseAdam", "wall_time", "s", wall, x_name="phase", x_value="all")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--trials", type=int, default=None, help="default 200, 10 with --quick")
    parser.add_argument("--server", action="store_true", help=argparse.SUPPRESS)  # the trial-forking process
    args = check.parse(parser, argv)
    if args.server:
        return server(args.seed)
    args.trials = args.trials or (10 if args.quick else 200)
    config = {**vars(args), "rows": ROWS, "dim": DIM, "batch": BATCH, "hot_rows": HOT, "lr": LR,
              "start_step": START, "total_steps": TOTAL, "checkpoint_every": EVERY}
    with Results("dsa_fault_injection", args, config=config) as res:
        t0 = time.perf_counter()
        counts = run_trials(args.trials, args.seed, log=lambda m: print(f"[dsa_fault_injection] {m}", flush=True))
        record(res, counts, time.perf_counter() - t0)
    failures = sum(c["failures"] for c in counts.values())
    print(f"[dsa_fault_injection] {args.trials} trials, {failures} failures; "
          + ", ".join(f"{s} in {p}: {c['trials']}" for (s, p), c in sorted(counts.items())), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
