"""Gefen under torch.distributed on CPU: DDP, FSDP2 (``fully_shard``) and distributed checkpoints.

Every distributed run is a real gloo group of separate processes on 127.0.0.1 (``_dist_worker.py``),
launched once per module with a hard timeout; each test then reads its scenario's result. The
references are single-process runs on the whole global batch, computed here from the worker's own
model/data definitions, and ``torch.optim.AdamW`` through the very same harness (so a harness bug
shows up on AdamW first).

Why the distributed-vs-single comparisons are not bitwise: the gradient of the global batch is
summed in a different order (two half-batch means averaged by all-reduce / reduce-scatter, against
one full-batch mean), which moves gradients by ~1 ulp; the DCP round trip, by contrast, replays the
same arithmetic on the same ranks and must match exactly.
"""

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.utils import assert_close

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _dist_worker as W  # noqa: E402

TIMEOUT_S = 120
HAVE_GEFEN = importlib.util.find_spec("optim.gefen.optimizer") is not None
OPTS = ["adamw"] + (["gefen_reduction", "gefen"] if HAVE_GEFEN else [])
gefen_only = pytest.mark.skipif(not HAVE_GEFEN, reason="optim/gefen/optimizer.py not written yet")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, specs: list, out_dir: Path, timeout: float = TIMEOUT_S) -> None:
    """Run ``_dist_worker.py`` on ``world`` gloo ranks on 127.0.0.1; kill them all after ``timeout``."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(HERE.parent))
    procs, logs = [], []
    for rank in range(world):
        log = open(out_dir / f"log.{'-'.join(s.split(':')[0] for s in specs[:1])}.rank{rank}.txt", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(HERE / "_dist_worker.py"), str(out_dir), *specs],
                                      env=dict(env, RANK=str(rank)), stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tails = "\n".join(Path(log.name).read_text()[-3000:] for log in logs)
        raise RuntimeError(f"distributed workers failed or timed out after {timeout}s (rank, code): {bad}\n{tails}")


def result(out_dir: Path, spec: str) -> dict:
    stem = spec.replace(":", "-")
    path = out_dir / f"{stem}.pt"
    errors = sorted(out_dir.glob(f"{stem}.rank*.pt"))
    if errors:
        path = errors[0]
    if not path.exists():
        earlier = sorted(str(torch.load(p)["error"]) for p in out_dir.glob("*.pt") if "error" in torch.load(p))
        pytest.fail(f"scenario {spec} produced no result; earlier failures: {earlier[:1]}")
    res = torch.load(path, weights_only=False)
    if "error" in res:
        pytest.fail(f"scenario {spec} failed in the worker:\n{res['error']}")
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank launch for every scenario, then one 1-rank launch that reloads its checkpoints."""
    out = tmp_path_factory.mktemp("dist")
    launch(2, [f"{s}:{o}" for o in OPTS for s in ("ddp", "fsdp", "dcp")], out)
    launch(1, [f"reshard:{o}" for o in OPTS], out)
    return out


@pytest.fixture(scope="module")
def references():
    return {o: W.single_process_run(o, W.K1 + W.K2) for o in OPTS}


def _assert_params_close(actual: dict, expected: dict, **tol):
    assert actual.keys() == expected.keys()
    for k in expected:
        assert_close(actual[k], expected[k], name=k, **tol)


# Distributed vs single process: ~1-ulp gradient differences grow through 6 Adam steps to ~1e-7.
DIST_TOL = dict(atol=2e-6, rtol=0, rel_rms_tol=1e-6)


@pytest.mark.parametrize("opt", OPTS)
def test_ddp_equals_single_process(runs, references, opt):
    res = result(runs, f"ddp:{opt}")
    params, losses = references[opt]
    _assert_params_close(res["params"], params, **DIST_TOL)


@pytest.mark.parametrize("opt", [o for o in OPTS if o != "gefen"])
def test_fsdp2_equals_single_process(runs, references, opt):
    res = result(runs, f"fsdp:{opt}")
    params, _ = references[opt]
    _assert_params_close(res["params"], params, **DIST_TOL)


@pytest.mark.parametrize("opt", OPTS)
def test_dcp_round_trip_continues_identically(runs, opt):
    res = result(runs, f"dcp:{opt}")
    _assert_params_close(res["resumed"], res["uninterrupted"], atol=0.0)
    assert_close(res["resumed_losses"], res["uninterrupted_losses"], atol=0.0, name="losses")


@pytest.mark.parametrize("opt", OPTS)
def test_dcp_two_ranks_to_one_rank(runs, opt):
    """A 2-rank checkpoint loaded on 1 rank continues like the 2-rank run (up to reduction order)."""
    res = result(runs, f"reshard:{opt}")
    ref = result(runs, f"dcp:{opt}")
    _assert_params_close(res["resumed"], ref["uninterrupted"], **DIST_TOL)
