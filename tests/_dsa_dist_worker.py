"""Worker for the distributed Disk Sparse Adam tests: one rank of a gloo group on 127.0.0.1, CPU only.

Run by ``tests/test_dsa_distributed.py`` (never collected by pytest: no ``test_`` prefix)::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python tests/_dsa_dist_worker.py OUT_DIR SCENARIO[:ARG] ...

Every rank writes ``OUT_DIR/<scenario>-<arg>.rank<r>.pt`` (a dict of tensors, or ``{"error":
traceback}``). The table, the global batches and the loss are defined here once, for the ranks
and for the single-process ``torch.optim.SparseAdam`` references the tests compute.
"""

import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn

ROWS, DIM = 37, 6  # 37 rows: uneven shards on 2 (19 + 18) and 3 ranks (13 + 13 + 11)
GLOBAL_BATCH = 48
HOT = 4  # rows that take most lookups: heavy duplicates within and across ranks
STEPS = 50
K1, K2 = 20, 10  # steps before and after a checkpoint
LR = 1e-2
BACKEND = "torch"  # the distributed logic does not depend on the kernels; torch needs no JIT compile per rank


# ----------------------------------------------------------------------------- shared definitions
def full_table(rows: int = ROWS, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)


def global_batch(step: int, rows: int = ROWS, dtype=torch.float32):
    """Indices (70% among the HOT first rows) and targets of step ``step``; the same in every process."""
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, rows, (GLOBAL_BATCH,), generator=g)
    hot = torch.rand(GLOBAL_BATCH, generator=g) < 0.7
    idx[hot] = torch.randint(0, min(HOT, rows), (int(hot.sum()),), generator=g)
    return idx, torch.randn(GLOBAL_BATCH, DIM, generator=g, dtype=torch.float64).to(dtype)


def rank_piece(step: int, rank: int, world: int, rows: int = ROWS, dtype=torch.float32):
    """Rank ``rank``'s contiguous piece of the global batch: every 7th step the last rank's piece is
    empty; even-length pieces come as 2-D indices (``nn.Embedding`` takes any shape)."""
    idx, y = global_batch(step, rows, dtype)
    parts = world - 1 if (step % 7 == 3 and world > 1) else world
    pieces = list(zip(idx.tensor_split(parts), y.tensor_split(parts)))
    pieces += [(idx[:0], y[:0])] * (world - parts)
    i, t = pieces[rank]
    return (i.reshape(-1, 2), t.reshape(-1, 2, DIM)) if i.numel() % 2 == 0 else (i, t)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out - target) ** 2).sum()


def reference(steps: int, rows: int = ROWS, dtype=torch.float32, scale: float = 1.0):
    """One process, the whole table, the whole global batches, ``torch.optim.SparseAdam``."""
    emb = nn.Embedding(rows, DIM, sparse=True, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(full_table(rows, dtype))
    opt = torch.optim.SparseAdam(emb.parameters(), lr=LR)
    for step in range(steps):
        idx, y = global_batch(step, rows, dtype)
        opt.zero_grad()
        (loss_fn(emb(idx), y) * scale).backward()
        opt.step()
    return {"weight": emb.weight.detach().clone(), **_moments(opt, emb.weight)}


# ----------------------------------------------------------------------------- helpers on the ranks
def _sharded_table(rows=ROWS, dtype=torch.float32, group=None, init=True):
    from optim.disk_sparse.sharded import ShardedEmbedding

    emb = ShardedEmbedding(rows, DIM, process_group=group, dtype=dtype)
    if init:
        with torch.no_grad():
            emb.weight.copy_(full_table(rows, dtype)[emb.row_start:emb.row_end])
    return emb


def _train(emb, opt, start, steps, rank, world, rows=ROWS, dtype=torch.float32):
    """Train ``steps`` steps; returns the bytes this rank sent per step (sharded tables)."""
    sent = []
    for step in range(start, start + steps):
        idx, y = rank_piece(step, rank, world, rows, dtype)
        before = getattr(emb, "exchanged_bytes", 0)
        opt.zero_grad()
        loss_fn(emb(idx), y).backward()
        opt.step()
        sent.append(getattr(emb, "exchanged_bytes", 0) - before)
    return torch.tensor(sent)


def _local_state(emb, opt) -> dict:
    return {"weight": emb.weight.detach().clone(), **_moments(opt, emb.weight), "rows": (emb.row_start, emb.row_end)}


def _save(emb, opt, path):
    import torch.distributed.checkpoint as dcp

    from optim.disk_sparse.sharded import dcp_state_dict

    dcp.save(dcp_state_dict(emb, opt), checkpoint_id=str(path))


def _load(emb, opt, path):
    import torch.distributed.checkpoint as dcp

    from optim.disk_sparse.sharded import dcp_state_dict, load_dcp_state_dict

    sd = dcp_state_dict(emb, opt)
    dcp.load(sd, checkpoint_id=str(path))
    load_dcp_state_dict(emb, opt, sd)


# ----------------------------------------------------------------------------- scenarios
def scenario_train(arg, rank, world, out):
    """``STEPS`` steps of the sharded table on ``arg`` = "ROWS-DTYPE" (e.g. "37-float32")."""
    from optim.disk_sparse.sharded import open_optimizer

    rows, dtype = int(arg.split("-")[0]), getattr(torch, arg.split("-")[1])
    emb = _sharded_table(rows, dtype)
    with open_optimizer(emb, out / f"state-train-{arg}-{world}", lr=LR, backend=BACKEND) as opt:
        sent = _train(emb, opt, 0, STEPS, rank, world, rows, dtype)
        return dict(_local_state(emb, opt), sent=sent)


def scenario_dcp(arg, rank, world, out):
    """K1 steps, ``dcp.save``, K2 more (uninterrupted); a fresh table and optimizer load it and take
    the same K2 steps (resumed). ``arg``: the table's rows (default ROWS)."""
    from optim.disk_sparse.sharded import open_optimizer

    rows = int(arg or ROWS)
    ckpt, state = out / f"ckpt{world}-{rows}", out / f"state-dcp-{world}-{rows}"
    emb = _sharded_table(rows)
    with open_optimizer(emb, state, lr=LR, backend=BACKEND) as opt:
        _train(emb, opt, 0, K1, rank, world, rows)
        saved = _local_state(emb, opt)
        _save(emb, opt, ckpt)
        _train(emb, opt, K1, K2, rank, world, rows)
        uninterrupted = _local_state(emb, opt)
    torch.manual_seed(1000 + rank)
    emb2 = _sharded_table(rows, init=False)  # other weights: the checkpoint must bring them
    with open_optimizer(emb2, f"{state}-resumed", lr=LR / 3, backend=BACKEND) as opt2:
        _load(emb2, opt2, ckpt)
        loaded = _local_state(emb2, opt2)
        _train(emb2, opt2, K1, K2, rank, world, rows)
        resumed = _local_state(emb2, opt2)
    return {"saved": saved, "loaded": loaded, "uninterrupted": uninterrupted, "resumed": resumed}


def scenario_reshard(arg, rank, world, out):
    """Load the checkpoint of ``scenario_dcp`` saved on ``arg`` ranks onto ``world`` ranks, train K2."""
    from optim.disk_sparse.sharded import open_optimizer

    emb = _sharded_table(init=False)
    with open_optimizer(emb, out / f"state-reshard-{arg}-{world}", lr=LR, backend=BACKEND) as opt:
        _load(emb, opt, out / f"ckpt{arg}-{ROWS}")
        loaded = _local_state(emb, opt)
        _train(emb, opt, K1, K2, rank, world)
        return {"loaded": loaded, "resumed": _local_state(emb, opt)}


def scenario_ddp(arg, rank, world, out):
    """``nn.Embedding(sparse=True)`` under DDP, DiskSparseAdam on every rank in its own state_dir;
    rank 0 saves ``opt.state_dict()`` and the weights at K1, every rank loads them into a fresh
    optimizer (new state_dir) and a fresh model and continues."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from optim import DiskSparseAdam

    def model():
        emb = nn.Embedding(ROWS, DIM, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(full_table())
        return DDP(emb)

    ddp = model()
    ckpt = out / "ddp_ckpt.pt"
    with DiskSparseAdam(ddp.parameters(), lr=LR, state_dir=out / f"state-ddp-rank{rank}",
                        backend=BACKEND) as opt:
        _train(ddp, opt, 0, K1, rank, world)
        if rank == 0:
            torch.save({"model": ddp.module.state_dict(), "optim": opt.state_dict()}, ckpt)
        _train(ddp, opt, K1, STEPS - K1, rank, world)
        final = {"weight": ddp.module.weight.detach().clone(), **_moments(opt, ddp.module.weight)}
    dist.barrier()
    ddp2 = model()
    sd = torch.load(ckpt, weights_only=True)
    ddp2.module.load_state_dict(sd["model"])
    with DiskSparseAdam(ddp2.parameters(), lr=LR, state_dir=out / f"state-ddp-resumed-rank{rank}",
                        backend=BACKEND) as opt2:
        opt2.load_state_dict(sd["optim"])
        _train(ddp2, opt2, K1, STEPS - K1, rank, world)
        resumed = ddp2.module.weight.detach().clone()
    return {"final": final, "resumed": resumed}


def _moments(opt, p):
    """``p``'s step and moments, from the state dict (the optimizer's state holds only steps)."""
    k = next(i for i, q in enumerate(q for g in opt.param_groups for q in g["params"]) if q is p)
    st = opt.state_dict()["state"][k]
    return {"exp_avg": st["exp_avg"].clone(), "exp_avg_sq": st["exp_avg_sq"].clone(), "step": int(st["step"])}


def scenario_weight_file(arg, rank, world, out):
    """Weights in files: train K1 steps, close; a new table reopens the weight files and the
    optimizer resumes from its clean state files; K2 more steps."""
    from optim.disk_sparse.sharded import ShardedEmbedding, open_optimizer

    emb = ShardedEmbedding(ROWS, DIM, weight_dir=out / "weights")
    with torch.no_grad():
        emb.weight.copy_(full_table()[emb.row_start:emb.row_end])
    with open_optimizer(emb, out / "wstate", lr=LR, backend=BACKEND) as opt:
        _train(emb, opt, 0, K1, rank, world)
    saved = emb.weight.detach().clone()
    del emb, opt
    emb = ShardedEmbedding(ROWS, DIM, weight_dir=out / "weights")
    reopened = emb.weight.detach().clone()
    with open_optimizer(emb, out / "wstate", resume=True, lr=LR, backend=BACKEND) as opt:
        _train(emb, opt, K1, K2, rank, world)
        final = _local_state(emb, opt)
    try:
        ShardedEmbedding(ROWS, DIM, dtype=torch.float64, weight_dir=out / "weights")
        ShardedEmbedding(ROWS + 4, DIM, weight_dir=out / "weights")
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    return {"saved": saved, "reopened": reopened, "final": final, "file": str(emb.weight_file),
            "message": message}


def scenario_steps_differ(arg, rank, world, out):
    """Every rank trains 2 steps and closes cleanly; rank 0 alone then takes one more step (a
    gradient of no rows, outside any collective). Reopening with resume=True must refuse on every rank."""
    from optim.disk_sparse.sharded import open_optimizer

    emb = _sharded_table()
    with open_optimizer(emb, out / "differ", lr=LR, backend=BACKEND) as opt:
        _train(emb, opt, 0, 2, rank, world)
        if rank == 0:
            emb.weight.grad = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0, DIM),
                                                      tuple(emb.weight.shape))
            opt.step()
    try:
        with open_optimizer(emb, out / "differ", resume=True, lr=LR, backend=BACKEND):
            return {"message": "opened"}
    except Exception as exc:
        return {"message": f"{type(exc).__name__}: {exc}"}


def scenario_bad_input(arg, rank, world, out):
    """One rank passes bad indices: every rank must raise (none left blocked); then a lookup works."""
    emb = _sharded_table()
    messages = {}
    for what, idx in (("range", torch.tensor([0, ROWS])), ("negative", torch.tensor([-1])),
                      ("dtype", torch.tensor([0.0, 1.0]))):
        try:
            emb(idx if rank == world - 1 else torch.tensor([1, 2]))
            messages[what] = "no error"
        except (IndexError, TypeError) as exc:
            messages[what] = f"{type(exc).__name__}: {exc}"
    out_rows = emb(torch.tensor([[ROWS - 1, 0], [0, 3]], dtype=torch.int32))
    from optim.disk_sparse.sharded import ShardedEmbedding

    try:
        ShardedEmbedding(ROWS, DIM + (rank == world - 1))  # another dim on one rank
        messages["dim"] = "no error"
    except ValueError as exc:
        messages["dim"] = f"{type(exc).__name__}: {exc}"
    return {"messages": messages, "rows": out_rows.detach(), "table": full_table()}


def scenario_one_rank_eval(arg, rank, world, out):
    """Rank 0 alone looks rows up between training steps (an evaluation), first under
    ``torch.no_grad()``, then with gradients on: its lookup pairs with the other ranks' next
    training lookup, so each case must raise on every rank naming the calls (never an abort inside
    gloo). Two tables looked up in another order on each rank are refused the same way. Then every
    rank looks up together (no gradient) and trains one step as usual."""
    from optim.disk_sparse.sharded import open_optimizer

    emb = _sharded_table()
    messages = {}
    with open_optimizer(emb, out / "one_rank_eval", lr=LR, backend=BACKEND) as opt:
        _train(emb, opt, 0, 1, rank, world)
        for what in ("no_grad", "grad"):
            try:
                if rank == 0:
                    with torch.set_grad_enabled(what == "grad"):
                        emb(torch.tensor([0, ROWS - 1]))
                _train(emb, opt, 1, 1, rank, world)
                messages[what] = "no error"
            except RuntimeError as exc:
                messages[what] = f"{type(exc).__name__}: {exc}"
            opt.zero_grad()
        other = _sharded_table(rows=5)
        try:
            with torch.no_grad():
                for table in ((emb, other) if rank == 0 else (other, emb)):
                    table(torch.tensor([1]))
            messages["order"] = "no error"
        except RuntimeError as exc:
            messages["order"] = f"{type(exc).__name__}: {exc}"
        with torch.no_grad():
            rows = emb(torch.tensor([[ROWS - 1, 0], [0, 3]]) if rank == 0 else torch.tensor([], dtype=torch.int64))
        at_lookup = emb.weight.detach().clone()
        _train(emb, opt, 1, 1, rank, world)
        return {"messages": messages, "looked_up": rows, "at_lookup": at_lookup, **_local_state(emb, opt)}


def scenario_crash(arg, rank, world, out):
    """Train a few steps with state in ``out/crash``; the last rank is SIGKILLed after a step (its
    files dirty), the others close cleanly. Must be the last scenario of its launch."""
    from optim.disk_sparse.sharded import open_optimizer

    emb = _sharded_table()
    opt = open_optimizer(emb, out / "crash", lr=LR, backend=BACKEND)
    _train(emb, opt, 0, 3, rank, world)
    torch.save(emb.weight.detach().clone(), out / f"crash-weights-rank{rank}.pt")  # what a restart loads
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    opt.close()
    return {"step": torch.tensor(3)}


def scenario_restart(arg, rank, world, out):
    """Reopen ``out/crash`` (saved by ``arg`` ranks) with resume=True on the first ``arg`` ranks."""
    import torch.distributed as dist

    from optim.disk_sparse.sharded import open_optimizer

    n = int(arg)
    group = dist.new_group(list(range(n)))  # collective over all ranks
    if rank >= n:
        return {}
    emb = _sharded_table(group=group)
    with torch.no_grad():  # the weights the state was trained with: only a dirty file may refuse
        emb.weight.copy_(torch.load(out / f"crash-weights-rank{rank}.pt"))
    try:
        with open_optimizer(emb, out / "crash", resume=True, lr=LR, backend=BACKEND):
            return {"message": "opened"}
    except Exception as exc:
        return {"message": f"{type(exc).__name__}: {exc}"}


SCENARIOS = {"train": scenario_train, "dcp": scenario_dcp, "steps_differ": scenario_steps_differ,
             "weight_file": scenario_weight_file, "reshard": scenario_reshard, "ddp": scenario_ddp,
             "bad_input": scenario_bad_input,
             "one_rank_eval": scenario_one_rank_eval, "crash": scenario_crash, "restart": scenario_restart}


def main(argv):
    import torch.distributed as dist

    out = Path(argv[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for spec in argv[1:]:
            name, _, arg = spec.partition(":")
            t0 = time.perf_counter()
            try:
                result = SCENARIOS[name](arg, rank, world, out)
            except Exception:  # recorded per scenario so that one failure does not hide the others
                result = {"error": f"rank {rank}: " + traceback.format_exc()}
            torch.save(result, out / f"{spec.replace(':', '-')}.w{world}.rank{rank}.pt")
            print(f"rank {rank}: {spec} {time.perf_counter() - t0:.1f} s", flush=True)
            if "error" in result or name == "crash":
                break  # the group may be out of step now (or a rank is gone)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
