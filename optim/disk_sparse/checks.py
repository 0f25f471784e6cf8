"""The checks of the Disk Sparse optimizers: parameters, hyper-parameters, gradients, loaded state.

Each raises with what is wrong and what to do. The messages of the checks SparseAdam also makes keep
SparseAdam's sentence, so PyTorch's optimizer tests (which match them) pass here too.
"""

from __future__ import annotations

import itertools
import numbers

import torch

from .._checks import check_flags, check_hyper, check_option, scalar  # noqa: F401  (the shared checks)
from .state import STEP
from .store import MAX_STEP, memory_limit_bytes


def check_options(owner, state_dir, backend, huge_pages, staging, resume, backends):
    """The file options of optimizer ``owner``: each one of its values, and ``resume`` only with a
    ``state_dir`` to resume from."""
    check_option("backend", backend, backends, f"one of {backends}")
    check_option("huge_pages", huge_pages, (None, True, False), "None (decide by size), True or False")
    check_option("staging", staging, (None, True, False), "None (staged for CUDA weights), True or False")
    check_flags(resume=resume)
    if resume and state_dir is None:
        raise ValueError(f"{owner}: resume=True continues from the state files in state_dir; give "
                         "state_dir (state_dir=None is a new private directory, with nothing to resume)")


def check_param(p, k, owner, dims):
    """``p`` (parameter ``k`` of optimizer ``owner``) is a dense real floating table of ``dims`` dims."""
    where = f"parameter {k} (shape {tuple(p.shape)}, dtype {p.dtype})"
    if p.is_sparse or p.layout != torch.strided:
        raise ValueError(f"{owner} requires dense parameter tensors; {where} is sparse "
                         "(the gradient is what is sparse: pass the dense weight)")
    if p.is_complex():
        raise ValueError(f"{owner} does not support complex parameters; {where}: "
                         "optimize torch.view_as_real(p) instead")
    if not p.is_floating_point():
        raise ValueError(f"{where}: {owner} needs a floating-point parameter")
    if p.dim() not in dims:
        raise ValueError(f"{where}: {owner} needs a {' or '.join(f'{d}-D' for d in dims)} table "
                         "such as nn.Embedding(..., sparse=True).weight")
    if p.dim() == 2 and p.shape[1] == 0:
        raise ValueError(f"{where}: the table has 0 columns, so there is nothing to optimize; "
                         "leave it out of the optimizer")


def check_grad(p, k, owner, rule):
    """``p.grad`` (of parameter ``k``) as the sparse gradient ``rule`` takes."""
    g = p.grad
    if not g.is_sparse:
        raise RuntimeError(
            f"parameter {k} (shape {tuple(p.shape)}) got a dense gradient; "
            f"{owner} needs sparse gradients: build the table with "
            "nn.Embedding(..., sparse=True) or nn.EmbeddingBag(..., sparse=True), or use "
            "torch.optim.Adam for dense parameters")
    if g.sparse_dim() == 1 or (g.sparse_dim() == 2 == p.dim() and rule.element_sparse is True):
        return g
    if g.sparse_dim() == 2 == p.dim():
        raise RuntimeError(f"parameter {k}: {owner} {rule.element_sparse}")
    raise RuntimeError(f"parameter {k}: {owner} takes row-sparse gradients "
                       "(sparse_dim 1, as nn.Embedding(sparse=True) produces)"
                       f"{' or element-sparse ones (dense.to_sparse())' if rule.element_sparse is True else ''}, "
                       f"got sparse_dim {g.sparse_dim()}")


def announced_param(params, param):
    """The parameter whose rows ``prefetch`` announces: ``param``, or else the only one of ``params``."""
    if param is None:
        if len(params) != 1:
            raise ValueError(f"prefetch: this optimizer has {len(params)} parameters; say which "
                             "one the indices belong to with param=")
        param = next(iter(params))
    return param


def announced_rows(indices, p, k) -> torch.Tensor:
    """The sorted unique rows (CPU int64) of ``indices`` announced for parameter ``k`` (``p``) by
    ``prefetch``: integers (any integer dtype and shape) inside the table."""
    indices = torch.as_tensor(indices)
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
        raise TypeError(f"prefetch: indices must be integers (row numbers), got {indices.dtype}")
    rows = torch.unique(indices.detach().reshape(-1).to("cpu", torch.int64))
    if rows.numel() and (rows[0] < 0 or rows[-1] >= p.shape[0]):
        raise IndexError(f"prefetch: indices must lie in [0, {p.shape[0]}) for parameter {k}")
    return rows


def saved_state_by_param(param_groups, state_dict) -> dict:
    """``state_dict['state']`` keyed by the parameters of ``param_groups``, after checking the state
    dict's keys, its groups and their sizes."""
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    if missing:
        raise ValueError(f"load_state_dict: the state dict lacks {' and '.join(map(repr, missing))}; give "
                         "what state_dict() returned (torch.load of a saved one)")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} parameter groups, this optimizer has "
                         f"{len(param_groups)}")
    for i, (sg, g) in enumerate(zip(saved_groups, param_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(f"state_dict's parameter group {i} has {len(sg['params'])} parameters, "
                             f"this optimizer's has {len(g['params'])}")
    id_map = dict(zip(itertools.chain.from_iterable(g["params"] for g in saved_groups),
                      itertools.chain.from_iterable(g["params"] for g in param_groups)))
    return {id_map[k]: v for k, v in state_dict["state"].items()}


def loaded_groups(state_dict, param_groups, rule, kept) -> list:
    """This optimizer's ``param_groups`` with the options of ``state_dict``'s groups, each checked by
    ``rule``; the options in ``kept`` (this optimizer's files) keep this optimizer's values."""
    groups = []
    for sg, g in zip(state_dict["param_groups"], param_groups):
        # a dict saved before ``maximize`` existed was minimizing (SparseAdam reads a missing key as
        # False); options SparseAdam does not have (``bitwise``, ...) keep this optimizer's values
        groups.append(dict(g, **{k: v for k, v in sg.items() if k != "params" and k not in kept}))
        if "maximize" in g and "maximize" not in sg:
            groups[-1]["maximize"] = False
        rule.check_group(groups[-1])
    return groups


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


CHECK_CHUNK_ELEMENTS = 1 << 22  # a value check looks at this many loaded values at a time, at most


def check_chunk_elements(limit: int | None) -> int:
    """Values a check looks at a time under a memory ``limit`` (bytes; None: unknown): at most
    ``CHECK_CHUNK_ELEMENTS``, and few enough that the check's temporaries (a few bytes a value)
    stay within a 64th of the limit."""
    if limit is None:
        return CHECK_CHUNK_ELEMENTS
    return max(1 << 12, min(CHECK_CHUNK_ELEMENTS, limit // 64))


def _holds(ok, val: torch.Tensor) -> bool:
    """``ok(val).all()``, a chunk of rows at a time: a state larger than memory (a checkpoint
    loaded with ``torch.load(mmap=True)``) is checked without a mask of its whole size."""
    if val.dim() == 0 or val.shape[0] == 0:
        return bool(ok(val).all())
    rows = max(1, check_chunk_elements(memory_limit_bytes()) // max(1, val[0].numel()))
    return all(bool(ok(val[r:r + rows]).all()) for r in range(0, val.shape[0], rows))


def loaded_columns(views: dict, entry, where: str, rule):
    """(the record columns of a saved state ``entry``, its step) checked against the state-dict
    ``views`` of the parameter's records and the value checks of ``rule``; (None, 0) for fresh state."""
    if not entry:
        return None, 0
    columns = []
    for key, view in views.items():
        if key not in entry:
            raise KeyError(f"{where} lacks {key!r} (state_format={rule.state_format!r} keeps "
                           f"{', '.join(views)}; a state dict of the other format cannot load here)")
        val = torch.as_tensor(entry[key])
        if view.is_floating_point() and not val.is_floating_point():
            raise TypeError(f"{where}: {key!r} has dtype {val.dtype}, expected a floating-point tensor "
                            f"(the state files hold {view.dtype})")
        if not view.is_floating_point() and val.dtype != view.dtype:
            raise TypeError(f"{where}: {key!r} has dtype {val.dtype}, expected {view.dtype}")
        if val.shape != view.shape:
            raise ValueError(f"{where}: {key!r} has shape {tuple(val.shape)}, expected {tuple(view.shape)}")
        if key in rule.value_checks:
            val = val.to(view.dtype)  # written as the record's bytes
            ok, must_hold = rule.value_checks[key]
            if not _holds(ok, val):
                raise ValueError(f"{where}: {key!r} must hold {must_hold}")
        columns.append(val if val.dim() == 2 else val.reshape(-1, 1))  # a 1-D table's state as N x 1 records
    if STEP not in entry:
        raise KeyError(f"{where} lacks {STEP!r}")
    return columns, checked_step(entry[STEP], where)
