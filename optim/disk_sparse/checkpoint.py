"""Checkpoints of the Disk Sparse optimizers: ``state_dict`` out of the state files, ``load_state_dict``
into them.

A load checks the whole state dict (groups, parameters, keys, shapes, dtypes, steps) before it writes
anything, so a bad one leaves every file as it was, and marks every table dirty before it writes
any, so a load cut short leaves a directory that is refused on reopening, never one at mixed steps.
"""

from __future__ import annotations

import copy
import itertools
import numbers

import torch

from .store import MAX_STEP

# State-dict keys (the same as torch.optim.SparseAdam's, so its checkpoints load here and back).
STEP, EXP_AVG, EXP_AVG_SQ = "step", "exp_avg", "exp_avg_sq"
# The compact format's (``compact.py``): m's row scales and int8 codes; EXP_AVG_SQ is then one per row.
EXP_AVG_SCALE, EXP_AVG_CODES = "exp_avg_scale", "exp_avg_codes"


def saved_state_by_param(opt, state_dict) -> dict:
    """``state_dict['state']`` keyed by ``opt``'s parameters, after checking groups and their sizes."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} parameter groups, this optimizer has "
                         f"{len(opt.param_groups)}")
    for i, (sg, g) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(f"state_dict's parameter group {i} has {len(sg['params'])} parameters, "
                             f"this optimizer's has {len(g['params'])}")
    id_map = dict(zip(itertools.chain.from_iterable(g["params"] for g in saved_groups),
                      itertools.chain.from_iterable(g["params"] for g in opt.param_groups)))
    return {id_map[k]: v for k, v in state_dict["state"].items()}


def checked_step(value, where: str) -> int:
    """A saved step as an int in ``[0, MAX_STEP]`` (Python int or one-element integer tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex():
            raise ValueError(f"{where}: step must be an integer, got a tensor {value!r}")
        value = int(value.item())
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{where}: step must be an integer, got {value!r}")
    if not 0 <= int(value) <= MAX_STEP:
        raise ValueError(f"{where}: step must lie in [0, {MAX_STEP}], got {value}")
    return int(value)


def loaded_columns(opt, p, entry):
    """(the record columns of a saved state entry, its step), or (None, 0) for fresh state."""
    if not entry:
        return None, 0
    where = f"state_dict's state of parameter {opt._index(p)}"
    columns = []
    views = opt._views(p, opt._stores[p].records)
    for key, view in views.items():
        if key not in entry:
            raise KeyError(f"{where} lacks {key!r} (state_format={opt.state_format!r} keeps "
                           f"{', '.join(views)}; a state dict of the other format cannot load here)")
        val = torch.as_tensor(entry[key])
        if view.is_floating_point() and not val.is_floating_point():
            raise TypeError(f"{where}: {key!r} has dtype {val.dtype}, expected a floating-point tensor "
                            f"(the state files hold {view.dtype})")
        if not view.is_floating_point() and val.dtype != view.dtype:
            raise TypeError(f"{where}: {key!r} has dtype {val.dtype}, expected {view.dtype}")
        if val.shape != view.shape:
            raise ValueError(f"{where}: {key!r} has shape {tuple(val.shape)}, expected {tuple(view.shape)}")
        if opt.state_format == "compact":
            val = val.to(view.dtype)  # written as bytes: float32 scales and moments
            ok = (val >= -127).all() if key == EXP_AVG_CODES else (torch.isfinite(val) & (val >= 0)).all()
            if not bool(ok):
                raise ValueError(f"{where}: {key!r} must hold "
                                 f"{'codes in [-127, 127]' if key == EXP_AVG_CODES else 'finite values >= 0'}")
        columns.append(val if val.dim() == 2 else val.reshape(-1, 1))  # a 1-D table's state as N x 1 records
    if STEP not in entry:
        raise KeyError(f"{where} lacks {STEP!r}")
    return columns, checked_step(entry[STEP], where)


def load_state_dict(opt, state_dict):
    """Check all of ``state_dict`` against ``opt``, then write it into ``opt``'s state files."""
    saved_state = saved_state_by_param(opt, state_dict)
    loaded = {p: loaded_columns(opt, p, saved_state.get(p)) for p in opt._stores}
    for stager, _, _ in opt._routes.values():  # announced records are about to be replaced
        stager.invalidate()
    for sg, g in zip(state_dict["param_groups"], opt.param_groups):
        # a dict saved before ``maximize`` existed was minimizing (SparseAdam reads a missing key as
        # False); options SparseAdam does not have (``bitwise``, ...) keep this optimizer's value
        g.update({k: v for k, v in sg.items() if k != "params"})
        if "maximize" in g and "maximize" not in sg:
            g["maximize"] = False
    for store in opt._stores.values():  # a kill during the writes below leaves every table dirty
        store.mark_dirty()
    for p, store in opt._stores.items():
        columns, step = loaded[p]
        store.write_all(columns, step)
        opt._steps[p] = step
        opt.state[p] = opt._state_entry(p)


def deep_copy(opt, memo):
    """``copy.deepcopy(opt)``: an independent optimizer over deep copies of the parameters, in a new
    private state_dir holding a copy of ``opt``'s state, with its step and state-dict hooks (as
    deepcopy gives SparseAdam's). Refused for a fixed state_dir, which two optimizers cannot share."""
    opt._check_open()
    if not opt._own_dir:
        raise RuntimeError(f"cannot deepcopy {type(opt).__name__} on the fixed state_dir {opt.state_dir}: "
                           "two optimizers cannot share it. Create one on another state_dir and "
                           "load_state_dict(opt.state_dict()) into it")
    from .base import DiskSparseOptimizer  # base imports this module

    groups = [{k: copy.deepcopy(v, memo) for k, v in g.items()} for g in opt.param_groups]
    twin = memo[id(opt)] = type(opt).__new__(type(opt))
    DiskSparseOptimizer.__init__(twin, groups, copy.deepcopy(opt.defaults, memo), backend=opt.backend,
                                 huge_pages=opt.huge_pages, staging=opt.staging, state_format=opt.state_format)
    load_state_dict(twin, opt.state_dict())
    for name, hooks in vars(opt).items():
        if name.startswith("_optimizer_") and name.endswith("_hooks"):
            setattr(twin, name, copy.copy(hooks))
    return twin
