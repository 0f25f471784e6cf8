"""Argument checks both optimizer families share, with PyTorch's sentences.

PyTorch's optimizer tests match the messages of ``torch.optim.SparseAdam`` and ``torch.optim.AdamW``
("Invalid learning rate: ...", "Invalid beta parameter at index 0: ..."), so the checks that those
optimizers make keep their sentence here, followed by what to do.
"""

from __future__ import annotations

import math
import numbers

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


def _number(name, value, *, tensor_ok=False) -> float:
    """``value`` as a float: a real number (not a bool, not a string) or, where ``tensor_ok``, a
    one-element real tensor; refused by name otherwise."""
    if isinstance(value, torch.Tensor) and tensor_ok:
        if value.numel() != 1 or value.is_complex():
            raise ValueError(f"Tensor {name} must be 1-element: give a scalar tensor or a float")
        return float(value.item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")


def check_hyper(lr, betas, eps, *, weight_decay=None, lr_may_be_zero=False):
    """The checks of SparseAdam (lr > 0) or AdamW (lr >= 0, ``weight_decay``) with their messages, and
    what torch leaves to a later ``TypeError`` or accepts: every value a finite real number (lr, betas
    and weight_decay may be one-element tensors, as torch's ``capturable`` optimizers take them)."""
    floor = ">=" if lr_may_be_zero else ">"

    def above(x):
        return math.isfinite(x) and (x >= 0.0 if lr_may_be_zero else x > 0.0)

    if not above(_number("lr", lr, tensor_ok=True)):
        raise ValueError(f"Invalid learning rate: {lr} (lr must be {floor} 0 and finite)")
    if not above(_number("eps", eps)):
        raise ValueError(f"Invalid epsilon value: {eps} (eps must be {floor} 0 and finite)")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be two numbers (beta1, beta2), got {betas!r}")
    for k, b in enumerate(betas):
        if not 0.0 <= _number(f"betas[{k}]", b, tensor_ok=True) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {k}: {b} (betas must be in [0, 1))")
    if weight_decay is not None:
        decay = _number("weight_decay", weight_decay, tensor_ok=True)
        if not (math.isfinite(decay) and decay >= 0.0):
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (weight_decay must be >= 0 and finite)")


def check_distinct(params, gi: int, owner: str):
    """No tensor twice in one group (torch refuses one in two groups and only warns here): the
    optimizers keep one state per tensor and update it once a step, in parallel where they can."""
    first = {}
    for pi, p in enumerate(params):
        k = first.setdefault(id(p), pi)
        if k != pi:
            raise ValueError(f"{owner}: group {gi} gives one tensor twice, as parameters {k} and {pi} (shape "
                             f"{tuple(p.shape)}); give each parameter once (a model's parameters() already does)")
