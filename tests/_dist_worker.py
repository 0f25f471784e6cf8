"""Worker for the distributed tests: one rank of a gloo group on 127.0.0.1, CPU only.

Run by ``tests/test_gefen_distributed.py`` (never collected by pytest: no ``test_`` prefix)::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python tests/_dist_worker.py OUT_DIR SCENARIO[:OPT] ...

Each scenario runs every rank through the same code and rank 0 writes ``OUT_DIR/<name>.pt`` (a dict
of tensors, or ``{"error": traceback}``), so one launch serves several tests. The model, the data
and the optimizers are defined here once, for the ranks and for the single-process references
(``ref``) alike. ``SCENARIO:OPT@1`` runs on rank 0 alone, in a process group of one.
"""

import contextlib
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn

GLOBAL_BATCH = 32
K1 = 3  # steps before the checkpoint
K2 = 3  # steps after it
LR = 1e-2


# ----------------------------------------------------------------------------- shared definitions
def make_model(seed: int = 0) -> nn.Module:
    """Small MLP whose weights have 64 / 48 / 8 / 1 rows: the last layer's single row leaves rank 1
    of 2 with empty local shards (FSDP2 shards dim 0 like torch.chunk)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 8),
                         nn.Tanh(), nn.Linear(8, 1))


def batch(i: int):
    """The global batch of step i: deterministic, identical in every process."""
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = torch.randn(GLOBAL_BATCH, 1, generator=g)
    return x, y


def make_optimizer(name: str, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    from optim import Gefen, GefenLayout

    if name == "gefen_reduction":
        return Gefen(params, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                     layout="adamw", backend="torch")
    if name == "gefen":
        return Gefen(params, layout="published", lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, backend="torch")
    if name == "gefenf":  # factored second moment
        return Gefen(params, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                     layout="factored", backend="torch")
    if name == "gefenc":  # factored at Gefen-X's bytes: row-group scales, one fp32 factor a matrix
        return Gefen(params, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, backend="torch",
                     layout=GefenLayout(factor_second_moment=True, share_vector_second_moment=True,
                                        share_matrix_rows=True, row_group_scales=True, whole_matrix_factor=True))
    if name == "gefenk":  # layout="compact": at 8 bits a bf16 column factor per square tile
        return Gefen(params, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, layout="compact", backend="torch")
    if name == "gefenh":  # the compact 4-bit layout with a bf16 column factor per square tile
        return Gefen(params, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, bits=4,
                     layout=GefenLayout(factor_second_moment=True, share_vector_second_moment=True, share_matrix_rows=True,
                                        row_group_scales=512, factor_dtype="bfloat16"), backend="torch")
    if name == "gefenr":  # 4-bit, factored, the codebook relearned every 2 steps (steps 3, 5, ...)
        return Gefen(params, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, bits=4,
                     layout=GefenLayout(factor_second_moment=True, codebook_refresh_every=2), backend="torch")
    if name == "gefen4":
        return Gefen(params, layout="published", lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, bits=4,
                     backend="torch")
    raise ValueError(f"unknown optimizer {name!r}")


def train_steps(model, opt, steps, *, rank=0, world=1, start=0, micro_batches=1, fixed_batch=False):
    """Plain training loop: rank r takes its contiguous slice of each global batch; mean MSE.

    ``micro_batches`` > 1 splits this rank's slice further and accumulates the gradient (each
    micro-batch's loss times 1/micro_batches), as a single rank replaying a 2-rank run does.
    Returns this rank's losses (the mean over its micro-batches).
    """
    losses = []
    for i in range(start, start + steps):
        x, y = batch(0 if fixed_batch else i)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        total = 0.0
        for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = ((model(xm) - ym) ** 2).mean() * (1.0 / micro_batches)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
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


def single_process_run(opt_name: str, steps: int, seed: int = 0, micro_batches: int = 1,
                       fixed_batch: bool = False):
    """Reference: one process, no distribution, the same global batches.

    With ``micro_batches = world`` the gradient is accumulated as DDP and FSDP2 form it: each
    micro-batch's mean loss times 1/world (a power of two: exact), summed, so the reference sees
    the very same gradients, bit for bit, as the ranks after their all-reduce / reduce-scatter.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers run single-threaded; so must the reference's matmuls
    try:
        model = make_model(seed)
        opt = make_optimizer(opt_name, model.parameters())
        losses = train_steps(model, opt, steps, micro_batches=micro_batches, fixed_batch=fixed_batch)
    finally:
        torch.set_num_threads(threads)
    return full_params(model), losses


# ----------------------------------------------------------------------------- distributed scenarios
GROUP = None  # the process group of the running scenario: None = all ranks; see main()


def _mesh():
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    import torch.distributed as dist

    if GROUP is not None:
        return DeviceMesh.from_group(GROUP, "cpu")
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _fsdp_model(seed: int = 0, hsdp: bool = False):
    """FSDP2 on all ranks; ``hsdp``: a (replicate=world, shard=1) mesh instead (HSDP placements
    (Replicate(), Shard(0)), gradients all-reduced over the replicas)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import torch.distributed as dist

    model = make_model(seed)
    mesh = (init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
            if hsdp else _mesh())
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _ddp_model(seed: int = 0):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(make_model(seed))


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
    model = _ddp_model(0)
    opt = make_optimizer(opt_name, model.parameters())
    losses = train_steps(model, opt, K1 + K2, rank=rank, world=world)
    params = {k.removeprefix("module."): v for k, v in full_params(model).items()}
    return {"params": params, "losses": losses}


def scenario_fsdp(opt_name, rank, world, out_dir):
    model = _fsdp_model(0)
    opt = make_optimizer(opt_name, model.parameters())
    losses = train_steps(model, opt, K1 + K2, rank=rank, world=world)
    return {"params": full_params(model), "losses": losses, "codebooks": _codebooks(opt)}


def local_states(model, opt) -> dict:
    """Every rank's Gefen state of every parameter as {name: [rank 0's dict, rank 1's, ...]} with
    per-element codes and first moments (the test compares them across shardings)."""
    import torch.distributed as dist

    from optim.gefen.reference import dequantize, unpack_codes
    from optim.gefen.state import scale_length

    mine = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p, {})
        if "block" not in st:
            continue
        n = p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        local = p.to_local() if hasattr(p, "to_local") else p
        d = {"block": st["block"], "v": st["v"].clone(), "rows": local.shape[0], "row_len": n // max(local.shape[0], 1)}
        if "w" in st:
            d["w"] = st["w"].clone()
        if "codes" in st:
            d["scale"] = scale_length(st)
            d["codes"] = unpack_codes(st["codes"], n, opt.bits).clone()
            d["scales"] = st["scales"].clone()
            d["m"] = dequantize(st["scales"], st["codes"], opt.codebook, numel=n, block=d["scale"],
                                bits=opt.bits)
        mine[name] = d
    out = [None] * dist.get_world_size(GROUP)
    dist.all_gather_object(out, mine, group=GROUP)
    names = [n for n, _ in model.named_parameters() if any(n in o for o in out)]
    return {name: [o.get(name) for o in out] for name in names}, opt.codebook.clone()


def _options(flat: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flat)


def _save(model, opt, path, flat=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, opt, options=_options(flat))}
    dcp.save(state, checkpoint_id=str(path))


def _load(model, opt, path, flat=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, opt, options=_options(flat))}
    dcp.load(state, checkpoint_id=str(path), process_group=GROUP)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=_options(flat))


def _forced_first_step(model, opt, rank, world, segments: dict):
    """Step 0 with the named parameters' local gradients replaced by ``structured_grad`` of the
    given segment lengths, so that Gefen picks those block lengths on this rank."""
    x, y = batch(0)
    ((model(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).mean().backward()
    params = dict(model.named_parameters())
    for name, segment in segments.items():
        g = params[name].grad.to_local()
        g.copy_(structured_grad(g.shape[0], g.shape[1], segment, seed=10 * rank + len(name)))
    opt.step()
    opt.zero_grad(set_to_none=True)


# Block lengths every rank's local shard of each weight takes in the "aligned" checkpoint.
ALIGNED_BLOCKS = {"0.weight": 16, "2.weight": 32, "4.weight": 16}


def scenario_dcp(opt_name, rank, world, out_dir, segments=None, tag="", ddp=False, hsdp=False):
    """Train K1 steps, save with DCP, train K2 more; a fresh model (other init) loads and trains K2.

    With ``segments`` the first step's gradients are forced (see ``_forced_first_step``)."""
    ckpt = Path(out_dir) / f"ckpt{tag}_{opt_name}"
    model = _ddp_model(0) if ddp else _fsdp_model(0, hsdp)
    opt = make_optimizer(opt_name, model.parameters())
    if segments:
        _forced_first_step(model, opt, rank, world, segments)
        train_steps(model, opt, K1 - 1, rank=rank, world=world, start=1)
    else:
        train_steps(model, opt, K1, rank=rank, world=world)
    _save(model, opt, ckpt)
    blocks = {n: opt.state[p].get("block", 1) for n, p in model.named_parameters()}
    saved = local_states(model, opt) if segments else None
    cont = train_steps(model, opt, K2, rank=rank, world=world, start=K1)
    uninterrupted = full_params(model)

    model2 = _ddp_model(1) if ddp else _fsdp_model(1, hsdp)
    opt2 = make_optimizer(opt_name, model2.parameters())
    _load(model2, opt2, ckpt)
    resumed_losses = train_steps(model2, opt2, K2, rank=rank, world=world, start=K1)
    return {"uninterrupted": uninterrupted, "uninterrupted_losses": cont, "blocks": blocks, "saved": saved,
            "resumed": full_params(model2), "resumed_losses": resumed_losses}


def scenario_dcp_fresh(opt_name, rank, world, out_dir):
    """A checkpoint of an optimizer that has not stepped yet (``get_optimizer_state_dict`` probes
    it with a zero-gradient step): neither saving it nor loading it may change the training."""
    ckpt = Path(out_dir) / f"ckpt_fresh_{opt_name}"
    runs = {}
    for how in ("plain", "saved_at_0", "loaded_at_0"):
        model = _fsdp_model(1 if how == "loaded_at_0" else 0)
        opt = make_optimizer(opt_name, model.parameters())
        if how == "saved_at_0":
            _save(model, opt, ckpt)
        if how == "loaded_at_0":
            _load(model, opt, ckpt)
        train_steps(model, opt, K1 + K2, rank=rank, world=world)
        runs[how] = {"params": full_params(model),
                     "blocks": {n: opt.state[p].get("block", 1) for n, p in model.named_parameters()}}
    return runs


def scenario_hsdp(opt_name, rank, world, out_dir):
    """HSDP placements: training equals the single process; a DCP round trip continues exactly."""
    res = scenario_dcp(opt_name, rank, world, out_dir, tag="_hsdp", hsdp=True)
    model = _fsdp_model(0, hsdp=True)
    assert [str(pl) for pl in model[0].weight.placements] == ["R", "S(0)"], model[0].weight.placements
    opt = make_optimizer(opt_name, model.parameters())
    train_steps(model, opt, K1 + K2, rank=rank, world=world)
    return dict(res, params=full_params(model), codebooks=_codebooks(opt))


def scenario_full_state_dict(opt_name, rank, world, out_dir):
    """StateDictOptions(full_state_dict=True): gathered on every rank, and gathered to rank 0 only
    (cpu_offload) then broadcast on loading; both must continue exactly."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    out = {}
    for how, save_opts, load_opts in (
            ("everywhere", StateDictOptions(full_state_dict=True), StateDictOptions(full_state_dict=True)),
            ("rank0", StateDictOptions(full_state_dict=True, cpu_offload=True),
             StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))):
        model = _fsdp_model(0)
        opt = make_optimizer(opt_name, model.parameters())
        train_steps(model, opt, K1, rank=rank, world=world)
        full = get_optimizer_state_dict(model, opt, options=save_opts)
        train_steps(model, opt, K2, rank=rank, world=world, start=K1)
        uninterrupted = full_params(model)
        model2 = _fsdp_model(0)
        train_steps(model2, make_optimizer(opt_name, model2.parameters()), K1, rank=rank, world=world)
        opt2 = make_optimizer(opt_name, model2.parameters())  # fresh: only the weights are equal
        set_optimizer_state_dict(model2, opt2, full, options=load_opts)
        train_steps(model2, opt2, K2, rank=rank, world=world, start=K1)
        out[how] = {"uninterrupted": uninterrupted, "resumed": full_params(model2)}
    return out


def scenario_dcp_ddp(opt_name, rank, world, out_dir):
    return scenario_dcp(opt_name, rank, world, out_dir, tag="_ddp", ddp=True)


def scenario_dcp_flat(opt_name, rank, world, out_dir):
    """flatten_optimizer_state_dict=True: saving works, loading must refuse with a clear error."""
    model = _ddp_model(0)
    opt = make_optimizer(opt_name, model.parameters())
    train_steps(model, opt, 1, rank=rank, world=world)
    _save(model, opt, Path(out_dir) / f"ckpt_flat_{opt_name}", flat=True)
    try:
        _load(model, opt, Path(out_dir) / f"ckpt_flat_{opt_name}", flat=True)
    except ValueError as exc:
        return {"message": str(exc)}
    return {"message": ""}


def scenario_dcp_aligned(opt_name, rank, world, out_dir):
    return scenario_dcp(opt_name, rank, world, out_dir, segments=ALIGNED_BLOCKS, tag="_aligned")


def scenario_reshard(opt_name, rank, world, out_dir, tag=""):
    """Load the 2-rank checkpoint of ``scenario_dcp`` on ``world`` ranks and train K2 steps, each
    rank splitting its slice into 2 / world micro-batches: the gradients are then bit for bit the
    2-rank run's, so any difference comes from the reloaded state."""
    model = _fsdp_model(1)
    opt = make_optimizer(opt_name, model.parameters())
    _load(model, opt, Path(out_dir) / f"ckpt{tag}_{opt_name}")
    blocks = {n: opt.state[p].get("block", 1) for n, p in model.named_parameters()}
    loaded = local_states(model, opt) if tag else None
    losses = train_steps(model, opt, K2, rank=rank, world=world, start=K1, micro_batches=2 // world)
    return {"resumed": full_params(model), "resumed_losses": losses, "blocks": blocks, "loaded": loaded}


def scenario_ddp_to_fsdp(opt_name, rank, world, out_dir):
    """Resume the DDP checkpoint of ``scenario_dcp_ddp`` under FSDP2 on the same ranks."""
    model = _fsdp_model(1)
    opt = make_optimizer(opt_name, model.parameters())
    _load(model, opt, Path(out_dir) / f"ckpt_ddp_{opt_name}")
    blocks = {n: opt.state[p].get("block", 1) for n, p in model.named_parameters()}
    train_steps(model, opt, K2, rank=rank, world=world, start=K1)
    return {"resumed": full_params(model), "blocks": blocks}


def scenario_reshard_aligned(opt_name, rank, world, out_dir):
    return scenario_reshard(opt_name, rank, world, out_dir, tag="_aligned")


def structured_grad(rows: int, cols: int, segment: int, seed: int) -> torch.Tensor:
    """A gradient whose magnitude changes every ``segment`` elements (Gefen picks P = segment)."""
    g = torch.Generator().manual_seed(seed)
    n = rows * cols // segment
    scale = 10 ** (torch.rand(n, 1, generator=g) * 4 - 2)
    return (scale * (1 + 0.1 * torch.randn(n, segment, generator=g))).reshape(rows, cols)


def scenario_dcp_mismatch(opt_name, rank, world, out_dir):
    """A checkpoint whose ranks chose different block lengths for ``2.weight`` (32 on rank 0, 16
    on rank 1, forced by its first gradient): it must not load onto one rank."""
    model = _fsdp_model(0)
    opt = make_optimizer(opt_name, model.parameters())
    _forced_first_step(model, opt, rank, world, {"2.weight": 32 if rank == 0 else 16})
    _save(model, opt, Path(out_dir) / f"ckpt_mismatch_{opt_name}")
    return {"block": torch.tensor(opt.state[model[2].weight]["block"])}


def scenario_reshard_mismatch(opt_name, rank, world, out_dir):
    model = _fsdp_model(1)
    opt = make_optimizer(opt_name, model.parameters())
    try:
        _load(model, opt, Path(out_dir) / f"ckpt_mismatch_{opt_name}")
    except ValueError as exc:
        return {"message": str(exc)}
    return {"message": ""}


def scenario_train(opt_name, rank, world, out_dir):
    """FSDP2 on a fixed global batch (memorisation): the global loss per step, and the codebooks."""
    import torch.distributed as dist

    model = _fsdp_model(0)
    opt = make_optimizer(opt_name, model.parameters())
    losses = train_steps(model, opt, 30, rank=rank, world=world, fixed_batch=True)
    dist.all_reduce(losses)
    return {"losses": losses / world, "codebooks": _codebooks(opt)}


def toy_hist(grads: dict) -> torch.Tensor:
    """A stand-in histogram function: counts of |g| in 10 bins of width 0.1 (last bin open)."""
    counts = torch.zeros(10, dtype=torch.int64)
    for g in grads.values():
        counts += torch.bincount((g.reshape(-1).abs() * 10).long().clamp(max=9), minlength=10)
    return counts


def scenario_hist(opt_name, rank, world, out_dir):
    """``global_histogram`` on a sharded and a replicated parameter with rank-specific data."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from optim.gefen.distributed import global_histogram

    mesh = _mesh()
    full = torch.randn(10, 3, generator=torch.Generator().manual_seed(7))
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    plain = torch.randn(5, generator=torch.Generator().manual_seed(8))  # the same on every rank
    counts = global_histogram(toy_hist, {sharded: sharded.to_local(), plain: plain})
    out = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(out, counts)
    return {"counts": torch.stack(out), "sharded_full": full, "plain": plain}


def sr_run(model, opt, steps, *, rank=0, world=1, hooked=False):
    """bf16 weights, stochastic rounding: ``steps`` global batches, the ordinary loop (micro-batches
    accumulated as the ranks' halves) or, ``hooked``, the step inside backward."""
    from optim import step_in_backward

    handle = step_in_backward(opt) if hooked else None
    for i in range(steps):
        x, y = batch(i)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        for xm, ym in zip(x.chunk(2 // world), y.chunk(2 // world)):
            (((model(xm.bfloat16()) - ym.bfloat16()) ** 2).float().mean() * (world / 2)).backward()
        if not hooked:
            opt.step()
            opt.zero_grad()
    if handle is not None:
        handle.remove()


def sr_optimizer(params):
    from optim import Gefen

    return Gefen(params, lr=LR, weight_decay=0.1, layout="adamw",
                 stochastic_rounding=True, backend="torch")


def scenario_fsdp_sr(opt_name, rank, world, out_dir):
    """FSDP2, bf16 weights with stochastic rounding, each parameter stepped inside backward: rank 1
    holds an empty shard of the last layer, whose hook comes first; ``opt_name`` "hooked" or "loop"."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(0).bfloat16()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    opt = sr_optimizer(model.parameters())
    sr_run(model, opt, K1, rank=rank, world=world, hooked=opt_name == "hooked")
    return {"params": full_params(model)}


def scenario_ddp_hooked(opt_name, rank, world, out_dir):
    """step_in_backward on a DDP model's optimizer: the refusal's message, or None where it
    installed."""
    from optim import step_in_backward

    opt = make_optimizer(opt_name, _ddp_model(0).parameters())
    try:
        step_in_backward(opt).remove()
    except RuntimeError as exc:
        return {"refused": str(exc)}
    return {"refused": None}


def scenario_ref(opt_name, rank, world, out_dir):
    """The single-process references (run by rank 0 alone: the same code version as the ranks,
    even while the optimizer's files are being edited)."""
    params, _ = single_process_run(opt_name, K1 + K2, micro_batches=2)
    _, fixed_batch_losses = single_process_run(opt_name, 30, fixed_batch=True, micro_batches=2)
    return {"params": params, "fixed_batch_losses": fixed_batch_losses}


SCENARIOS = {
    "ref": scenario_ref,
    "hist": scenario_hist,
    "ddp": scenario_ddp,
    "fsdp": scenario_fsdp,
    "dcp": scenario_dcp,
    "reshard": scenario_reshard,
    "dcp_mismatch": scenario_dcp_mismatch,
    "reshard_mismatch": scenario_reshard_mismatch,
    "train": scenario_train,
    "dcp_aligned": scenario_dcp_aligned,
    "reshard_aligned": scenario_reshard_aligned,
    "dcp_ddp": scenario_dcp_ddp,
    "dcp_fresh": scenario_dcp_fresh,
    "hsdp": scenario_hsdp,
    "ddp_to_fsdp": scenario_ddp_to_fsdp,
    "full_sd": scenario_full_state_dict,
    "dcp_flat": scenario_dcp_flat,
    "fsdp_sr": scenario_fsdp_sr,
    "ddp_hooked": scenario_ddp_hooked,
}


@contextlib.contextmanager
def _alone(alone: bool):
    """A scenario on rank 0 alone: Gefen's seed is its own (``shared_seed`` broadcasts it over the
    default group, which the other rank is not stepping in), as in a process without a group."""
    if not alone:
        yield
        return
    from optim.gefen import distributed as gd

    shared = gd.shared_seed
    gd.shared_seed = lambda seed: seed
    try:
        yield
    finally:
        gd.shared_seed = shared


def main(argv):
    """Run the scenarios in order. ``SCENARIO:OPT@1`` runs on rank 0 alone, in a group of one
    (a 1-rank job inside the same launch: it saves starting a second set of processes)."""
    global GROUP
    import torch.distributed as dist

    out_dir = Path(argv[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    solo = dist.new_group([0])
    try:
        for spec in argv[1:]:
            name, _, opt_name = spec.partition(":")
            opt_name, _, alone = opt_name.partition("@")
            t0 = time.perf_counter()
            if alone and rank != 0:
                dist.barrier()  # rank 0 runs it on its own
                continue
            GROUP = solo if alone else None
            try:
                with _alone(alone):
                    result = SCENARIOS[name](opt_name or "adamw", 0 if alone else rank, 1 if alone else world,
                                             out_dir)
            except Exception:  # recorded per scenario so that one failure does not hide the others
                result = {"error": f"rank {rank}: " + traceback.format_exc()}
            # Keep ranks in step even when one failed half-way (a failed collective raises on all).
            if rank == 0 or "error" in result:
                stem = spec.replace(":", "-").partition("@")[0]
                path = out_dir / (stem + ("" if rank == 0 else f".rank{rank}") + ".pt")
                torch.save(result, path)
            print(f"rank {rank}: {spec} {time.perf_counter() - t0:.1f} s", flush=True)
            if "error" in result:
                break  # the group may be out of step now; the remaining scenarios report missing
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
