"""When Gefen learns its model-wide codebook, and from which gradients.

The first step learns the codebook from the gradients of every parameter of the groups that quantise
their first moment (summed over the ranks under FSDP2, so every rank learns the same one); with
``codebook_refresh_every`` a later step learns it again from that step's gradients and re-encodes
every stored code onto it. These functions read and write a ``Gefen`` optimizer's groups, state
and ``codebook.Codebook``; ``Gefen`` calls them from its step and from ``learn_from_gradients``.
"""

from __future__ import annotations

import torch

from .._base import local_tensor
from . import distributed as _dist, state as K
from .checks import check_param
from .codebook import refresh_due
from .plan import signed
from .tiling import remap_codes_


def quantised(opt, with_grad: bool = False) -> list:
    """The parameters of ``opt``'s groups that quantise their first moment (those with a gradient now)."""
    return [p for g in opt.param_groups if g["quantize_first_moment"] for p in g["params"]
            if not with_grad or p.grad is not None]


def learn_first(opt, grads: dict, blocks: dict | None = None) -> None:
    """Learn the codebook, where there is none yet, from ``grads`` ({param: gradient as stepped}) of the
    quantised groups (``Gefen.codebook_histogram``'s ``blocks``). A rank whose local shards are all
    empty still joins the collective of the others."""
    qparams = quantised(opt, with_grad=True)
    if opt.codebook is not None or not (grads or _dist.joins_codebook(qparams)):
        return
    dev = next(iter(grads.values())).device if grads else local_tensor(qparams[0]).device
    counts = _dist.global_histogram(lambda gs: opt.codebook_histogram(gs, blocks), grads, qparams)
    opt.learn_codebook(counts, device=dev)


def learn_from_gradients(opt) -> None:
    """``Gefen.learn_from_gradients``: the codebook from every gradient now in ``p.grad``, checking
    each parameter and choosing its block as the step would, without stepping; at a refresh step
    the codebook learned again; nothing otherwise."""
    if opt.codebook is not None:
        t = refresh_step(opt)
        if t is not None:
            refresh(opt, t)
        return
    if not opt.needs_every_gradient():
        return
    grads, blocks = {}, {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            check_param(p, gi, pi)
            if p.grad is None or local_tensor(p).numel() == 0:
                continue
            opt._backend(p, group, gi, pi)
            g = local_tensor(p.grad)
            block = K.next_block(opt.state[p], g, group, opt.block_rule,
                                 where=f"parameter {pi} of group {gi} (shape {tuple(p.shape)})")
            if block is not None and group["quantize_first_moment"]:
                grads[p], blocks[p] = signed(g, group), block
    learn_first(opt, grads, blocks)


def refresh_step(opt) -> int | None:
    """The step about to be taken where it relearns the codebook (``codebook.refresh_due``), or None:
    none is due, its refresh is done, or there is no codebook yet. The step is the one after the
    latest of the quantised parameters that have a gradient now (over the ranks under FSDP2): under
    ``step_in_backward`` the parameters stepped so far in a backward have none left, so the others'
    count still names the step under way."""
    if not opt.codebook_refresh_every or opt.codebook is None:
        return None
    qparams = quantised(opt)
    steps = [st[K.STEP] for p in qparams if p.grad is not None and K.CODES in (st := opt.state.get(p, {}))]
    t = _dist.latest_step(max(steps, default=0), qparams) + 1
    return t if refresh_due(t, opt.codebook_refresh_every) and t != opt._refreshed_at else None


def refresh(opt, t: int) -> None:
    """At step ``t`` (``refresh_step``'s), learn the codebook again from the gradients now in ``p.grad``
    of the quantised parameters with codes, as the first step learns it, and re-encode every stored
    code onto it (``Codebook.relearn``). Without a gradient on any rank there is nothing to learn
    from: the next call with gradients does it. NaN and infinite gradient elements count as zeros
    here (the step then treats them as any step does), so a bad step does not stop training where
    it happens to be a refresh step."""
    grads = {p: finite(signed(local_tensor(p.grad), g)) for g in opt.param_groups if g["quantize_first_moment"]
             for p in g["params"] if p.grad is not None and K.CODES in opt.state.get(p, {})}
    qparams = quantised(opt, with_grad=True)
    if not (grads or _dist.joins_codebook(qparams)):
        return
    counts = _dist.global_histogram(opt.codebook_histogram, grads, qparams)
    if int(counts.sum()) == 0:  # no rank had a gradient element
        return
    table = opt._codebook.relearn(counts)
    for st in opt.state.values():
        if K.CODES in st:
            remap_codes_(st[K.CODES], table)
    opt._refreshed_at = t
    opt._drop_plans()


def finite(g: torch.Tensor) -> torch.Tensor:
    """``g``, or a copy with its NaN and infinite elements as zeros where it has any."""
    return g if bool(torch.isfinite(g).all()) else torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
