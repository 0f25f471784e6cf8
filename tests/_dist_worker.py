"""Worker for the distributed tests: one rank of a gloo group on 127.0.0.1, CPU only.

Run by ``tests/test_gefen_distributed.py`` (never collected by pytest: no ``test_`` prefix)::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python tests/_dist_worker.py OUT_DIR SCENARIO[:OPT] ...

Each scenario runs every rank through the same code and rank 0 writes ``OUT_DIR/<name>.pt`` (a dict
of tensors, or ``{"error": traceback}``), so one launch serves several tests. The model, the data
and the optimizers are defined here once; the test process imports this module to compute its
single-process references from the same definitions.
"""

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GLOBAL_BATCH = 32
K1 = 3  # steps before the checkpoint
K2 = 3  # steps after it


# ----------------------------------------------------------------------------- shared definitions
def make_model(seed: int = 0) -> nn.Module:
    """Small MLP whose weights have 64 / 48 / 8 rows: dim 0 splits evenly over 1, 2 or 4 ranks."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 8))


def batch(i: int):
    """The global batch of step i: deterministic, identical in every process."""
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = torch.randn(GLOBAL_BATCH, 8, generator=g)
    return x, y


def make_optimizer(name: str, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    from optim import Gefen

    if name == "gefen_reduction":
        return Gefen(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                     share_second_moment=False, quantize_first_moment=False, backend="torch")
    if name == "gefen":
        return Gefen(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, backend="torch")
    if name == "gefen4":
        return Gefen(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, bits=4,
                     backend="torch")
    raise ValueError(f"unknown optimizer {name!r}")


def train_steps(model, opt, steps, *, rank=0, world=1, start=0):
    """Plain training loop: rank r takes its contiguous slice of each global batch; mean MSE."""
    losses = []
    for i in range(start, start + steps):
        x, y = batch(i)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return torch.stack(losses)


def full_params(model) -> dict:
    """Parameters as plain full tensors (collective for DTensors: every rank must call it)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.clone()
    return out


def single_process_run(opt_name: str, steps: int, seed: int = 0):
    """Reference: one process, the whole global batch, no distribution at all."""
    model = make_model(seed)
    opt = make_optimizer(opt_name, model.parameters())
    losses = train_steps(model, opt, steps)
    return full_params(model), losses


# ----------------------------------------------------------------------------- distributed scenarios
def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed as dist

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _fsdp_model(seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed)
    mesh = _mesh()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _codebooks(opt):
    """Every rank's codebook, gathered (for the 'same codebook on every rank' check)."""
    import torch.distributed as dist

    cb = getattr(opt, "codebook", None)
    if cb is None:
        return None
    cb = cb.detach().float().contiguous()
    out = [torch.empty_like(cb) for _ in range(dist.get_world_size())]
    dist.all_gather(out, cb)
    return torch.stack(out)


def scenario_ddp(opt_name, rank, world, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(0))
    opt = make_optimizer(opt_name, model.parameters())
    losses = train_steps(model, opt, K1 + K2, rank=rank, world=world)
    params = {k.removeprefix("module."): v for k, v in full_params(model).items()}
    return {"params": params, "losses": losses}


def scenario_fsdp(opt_name, rank, world, out_dir):
    model = _fsdp_model(0)
    opt = make_optimizer(opt_name, model.parameters())
    losses = train_steps(model, opt, K1 + K2, rank=rank, world=world)
    return {"params": full_params(model), "losses": losses, "codebooks": _codebooks(opt)}


def _save(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=str(path))


def _load(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def scenario_dcp(opt_name, rank, world, out_dir):
    """Train K1 steps, save with DCP, train K2 more; a fresh model (other init) loads and trains K2."""
    ckpt = Path(out_dir) / f"ckpt_{opt_name}"
    model = _fsdp_model(0)
    opt = make_optimizer(opt_name, model.parameters())
    train_steps(model, opt, K1, rank=rank, world=world)
    _save(model, opt, ckpt)
    cont = train_steps(model, opt, K2, rank=rank, world=world, start=K1)
    uninterrupted = full_params(model)

    model2 = _fsdp_model(1)
    opt2 = make_optimizer(opt_name, model2.parameters())
    _load(model2, opt2, ckpt)
    resumed_losses = train_steps(model2, opt2, K2, rank=rank, world=world, start=K1)
    return {"uninterrupted": uninterrupted, "uninterrupted_losses": cont,
            "resumed": full_params(model2), "resumed_losses": resumed_losses}


def scenario_reshard(opt_name, rank, world, out_dir):
    """Load the checkpoint written by ``scenario_dcp`` (on another number of ranks) and train K2."""
    model = _fsdp_model(1)
    opt = make_optimizer(opt_name, model.parameters())
    _load(model, opt, Path(out_dir) / f"ckpt_{opt_name}")
    losses = train_steps(model, opt, K2, rank=rank, world=world, start=K1)
    return {"resumed": full_params(model), "resumed_losses": losses}


SCENARIOS = {"ddp": scenario_ddp, "fsdp": scenario_fsdp, "dcp": scenario_dcp, "reshard": scenario_reshard}


def main(argv):
    import torch.distributed as dist

    out_dir = Path(argv[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for spec in argv[1:]:
            name, _, opt_name = spec.partition(":")
            try:
                result = SCENARIOS[name](opt_name or "adamw", rank, world, out_dir)
            except Exception:  # recorded per scenario so that one failure does not hide the others
                result = {"error": f"rank {rank}: " + traceback.format_exc()}
            # Keep ranks in step even when one failed half-way (a failed collective raises on all).
            if rank == 0 or "error" in result:
                path = out_dir / (f"{spec.replace(':', '-')}" + ("" if rank == 0 else f".rank{rank}") + ".pt")
                torch.save(result, path)
            if "error" in result:
                break  # the group may be out of step now; the remaining scenarios report missing
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
