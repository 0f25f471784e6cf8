"""Argument checks both optimizer families share, with PyTorch's sentences.

PyTorch's optimizer tests match the messages of ``torch.optim.SparseAdam`` and ``torch.optim.AdamW``
("Invalid learning rate: ...", "Invalid beta parameter at index 0: ..."), so the checks that those
optimizers make keep their sentence here, followed by what to do.
"""

from __future__ import annotations

import torch


def scalar(x) -> float:
    """A float of a Python number or a one-element tensor."""
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def check_flags(**flags):
    """Each flag is True or False (a string such as "no" would otherwise count as True)."""
    for name, value in flags.items():
        if value not in (True, False):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def check_option(name, value, allowed, meaning):
    """``value`` is one of ``allowed`` (and of the same type: 8.0 is not the int 8); ``meaning``
    says what the option takes."""
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
        raise ValueError(f"{name} must be {meaning}, got {value!r}")


def check_hyper(lr, betas, eps, *, weight_decay=None, lr_may_be_zero=False):
    """The checks of SparseAdam (lr > 0) or AdamW (lr >= 0, ``weight_decay``) with their messages."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element: give a scalar tensor or a float")
    if not (scalar(lr) >= 0.0 if lr_may_be_zero else scalar(lr) > 0.0):
        raise ValueError(f"Invalid learning rate: {lr} (lr must be {'>=' if lr_may_be_zero else '>'} 0)")
    if not eps >= 0.0 if lr_may_be_zero else not eps > 0.0:
        raise ValueError(f"Invalid epsilon value: {eps} (eps must be {'>=' if lr_may_be_zero else '>'} 0)")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be two numbers (beta1, beta2), got {betas!r}")
    for k, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {k}: {b} (betas must be in [0, 1))")
    if weight_decay is not None and not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (weight_decay must be >= 0)")
