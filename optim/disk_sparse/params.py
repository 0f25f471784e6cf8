"""Checks and file helpers of the Disk Sparse optimizers: which parameters they take, their state_dir."""

from __future__ import annotations

import os
import shutil

import torch


def _clear_state(opt):
    """Drop the state views (absent when Optimizer.__init__ refused the params before making it)."""
    state = opt.__dict__.get("state")
    if state is not None:
        state.clear()


def _state_files_in(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".dsa"))


def _remove_dir_of(owner, path):
    """Remove a private state_dir, in the process that made it only (not in a forked child)."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def _make_writable_dir(path):
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create state_dir {path}: {exc.strerror}; "
                                 "give a writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"state_dir {path} is not writable; give a writable directory")


def _check_param(p, k, owner, dims):
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


def _cols(p):
    """Values per row: a 1-D table is kept as N rows of one value."""
    return p.shape[1] if p.dim() == 2 else 1
