"""In-place torch path of the Disk Sparse Adam row updates, for weights on any device.

The launchers take the signature every backend shares (``numba_ops``, ``triton_ops``)::

    fn(w, g, state, step, *, <the rule's hyper-parameters>) -> None

``w``: ``(n, D)`` gathered weight rows, updated in place (any floating dtype); ``g``: ``(n, D)``
coalesced gradient rows in the state dtype; ``state``: ``(n, W)`` records of those rows, updated in
place: ``[m (D) | v (D)]`` for Adam, ``[m (D) | v (1)]`` for the ball, or bytes of the compact
format (``compact.py``) for the ``compact_*`` functions. Weights of another dtype than
the state are updated in the state dtype and rounded back. ``coalesce_rows`` turns a sparse
gradient into those unique rows.
"""

from __future__ import annotations

import math

import torch

from . import compact
from .reference import compact_adam_rows, compact_riemannian_adam_rows, riemannian_adam_rows


def coalesce_rows(indices: torch.Tensor, values: torch.Tensor):
    """Sorted unique rows of a row-sparse gradient and their summed values.

    Duplicates are summed in the order ``torch.Tensor.coalesce`` sums them on CPU (the order of
    ``indices.sort()``'s permutation), so the result is bitwise that of ``grad.coalesce()``; it avoids
    building a sparse tensor and costs one sort plus one ``index_add_``.
    """
    s, perm = indices.sort()
    n = s.numel()
    new = torch.ones(n, dtype=torch.bool, device=s.device)
    if n > 1:
        torch.ne(s[1:], s[:-1], out=new[1:])
    rows = s[new]
    vals = values.index_select(0, perm)
    if rows.numel() == n:
        return rows, vals
    inv = new.cumsum(0).sub_(1)
    return rows, vals.new_zeros((rows.numel(),) + tuple(values.shape[1:])).index_add_(0, inv, vals)


def adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, maximize=False, bitwise=True) -> None:
    """In-place twin of ``reference.sparse_adam_rows`` on records ``state = [m | v]``.

    The operations and their order are those of the reference (and of ``torch.optim.SparseAdam``), so
    results are bitwise equal to it. ``bitwise`` stays in the signature because the exact Adam rule
    passes one set of keywords to every backend's ``rows_fn`` (``rules.Rule.hyper``) and numba's reads
    it; this path is always bitwise.
    """
    d = g.shape[1]
    m, v = state[:, :d], state[:, d:]
    if maximize:
        g = -g
    u_m = torch.sub(g, m).mul_(1 - beta1)
    u_v = g.pow(2).sub_(v).mul_(1 - beta2)
    m.add_(u_m)  # m + u_m == u_m + m_old: the numerator of the reference
    v.add_(u_v)
    denom = torch.sqrt(v, out=u_v).add_(eps)
    step_size = lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
    delta = torch.div(m, denom, out=u_m).mul_(-step_size)
    if w.dtype == state.dtype:
        w.add_(delta)  # w + delta, as SparseAdam's sparse add
    else:
        w.copy_(w.to(state.dtype).add_(delta))


def riemannian_adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, c, exact) -> None:
    """In-place ``reference.riemannian_adam_rows`` on records ``state = [m | v]`` of width D+1."""
    d = w.shape[1]
    x, m, v = riemannian_adam_rows(w.to(state.dtype), g, state[:, :d], state[:, d:], step, lr=lr,
                                   beta1=beta1, beta2=beta2, eps=eps, c=c, exact=exact)
    state[:, :d] = m
    state[:, d:] = v
    w.copy_(x)


def compact_adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, maximize=False) -> None:
    """In-place ``reference.compact_adam_rows`` on compact records ``state`` (uint8, ``compact.py``).
    The update runs in float32."""
    d = w.shape[1]
    s, v, q = compact.views(state, d)
    w_new, q_new, s_new, v_new = compact_adam_rows(w.float(), g.float(), q, s, v, step, lr=lr, beta1=beta1,
                                                   beta2=beta2, eps=eps, maximize=maximize)
    q.copy_(q_new)
    s.copy_(s_new)
    v.copy_(v_new)
    w.copy_(w_new)


def compact_riemannian_adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, c, exact) -> None:
    """In-place ``reference.compact_riemannian_adam_rows`` on compact records ``state``."""
    d = w.shape[1]
    s, v, q = compact.views(state, d)
    w_new, q_new, s_new, v_new = compact_riemannian_adam_rows(w.float(), g.float(), q, s, v, step, lr=lr,
                                                              beta1=beta1, beta2=beta2, eps=eps, c=c, exact=exact)
    q.copy_(q_new)
    s.copy_(s_new)
    v.copy_(v_new)
    w.copy_(w_new)
