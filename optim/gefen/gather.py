"""A Gefen step's work: each parameter's state made ready for its gradient, and the step's calls.

``gather`` checks every parameter, creates the state of those at their first non-zero gradient
(``state.first_gradient``), re-cuts a provisional block and follows a cast; ``calls`` buckets one
group's parameters into ``plan.Call`` s; ``path`` is the data-dependent half of a parameter's
backend (the other half, chosen when the parameter is added, is ``optim.backends.choose_backend``).
These functions read and write a ``Gefen`` optimizer's groups and state.
"""

from __future__ import annotations

from collections import defaultdict

from .._base import local_tensor
from . import state as K
from .checks import check_capturable, check_param, check_state_fits
from .partition import constant_magnitude
from .plan import Call, draw_seeds, every_parameter_seeded, rounds_codes, seeded, step_module, tiles_of


def path(opt, backend: str, group: dict, block, scale=None) -> str:
    """``backend``, or "torch" where its ``data_refusal`` hands the step to the torch step for what
    only data decide: ``block`` (a parameter's block length, None before it is chosen), ``scale``
    (its scale blocks, ``state.SCALE_BLOCK``) and the codebook (None before it is learned). A group
    whose codes are rounded stochastically always takes the torch step (its ``refuses``)."""
    if backend == "torch" or rounds_codes(group):
        return "torch"
    quant = group["quantize_first_moment"]
    tables = opt._codebook.table() if quant and opt.codebook is not None else None
    why = step_module(backend).data_refusal(block=block, bits=opt.bits, quant=quant, tables=tables, scale=scale)
    return backend if why is None else "torch"


def gather(opt) -> list:
    """[(group, [(p, grad, backend)])] of the parameters with gradients, each through ``prepare``."""
    out = []
    for gi, group in enumerate(opt.param_groups):
        items = []
        for pi, p in enumerate(group["params"]):
            check_param(p, gi, pi)
            backend = prepare(opt, p, group, gi, pi)
            if backend is not None:
                items.append((p, p.grad, backend))
        out.append((group, items))
    return out


def prepare(opt, p, group: dict, gi: int, pi: int) -> str | None:
    """``p``'s backend once its state is ready for this gradient (created at the first non-zero one,
    re-cut, cast), None where no kernel steps ``p`` now (no gradient, no elements, or an all-zero
    first gradient, which ``state.first_gradient`` has stepped)."""
    if p.grad is None or local_tensor(p).numel() == 0:
        return None
    backend = opt._backend(p, group, gi, pi)
    st, x, g = opt.state[p], local_tensor(p), local_tensor(p.grad)
    where = f"parameter {pi} of group {gi}"
    if K.BLOCK not in st:
        if not K.first_gradient(st, x, g, group, where=f"{where} (shape {tuple(p.shape)})", bits=opt.bits,
                                block_rule=opt.block_rule, capturable=opt.capturable):
            return None
        opt._drop_plans()
        if opt.verbose:
            print(f"Gefen: {where}, shape {tuple(p.shape)}: block {st[K.BLOCK]} "
                  f"({g.numel() // st[K.BLOCK]} second moments)")
    else:
        check_state_fits(st, x, group, opt.bits, where)
        if K.follow_cast(st, K.state_dtype(x.dtype, group)):
            opt._drop_plans()
    if st.get(K.PROVISIONAL) and not constant_magnitude(g):
        K.recut(st, g, group, codebook=opt.codebook, bits=opt.bits, block_rule=opt.block_rule)
        opt._drop_plans()
    return backend


def calls(opt, group: dict, items: list) -> list:
    """The ``plan.Call`` s of one group's parameters with gradients (``gather``'s items): one a bucket of
    block length, step, device, state dtype, path, factor (whether the state holds w: a vector may
    hold none in a factored group, ``state.holds_factor``) and scale blocks."""
    buckets = defaultdict(list)
    for p, _, backend in items:
        st = opt.state[p]  # device step counters are each read on the device: no split by step
        step = None if opt.capturable else st[K.STEP]
        buckets[(st[K.BLOCK], step, local_tensor(p).device, st[K.V].dtype, backend, K.W in st,
                 st.get(K.SCALE_BLOCK))].append(p)
    out = []
    for (block, _, _, _, backend, _, scale), params in buckets.items():
        states = [opt.state[p] for p in params]
        if seeded(group):
            draw_seeds(params, states, opt._seed, opt.param_groups, every=every_parameter_seeded(group))
        tiles = [t for k, (p, st) in enumerate(zip(params, states))
                 for t in tiles_of(k, local_tensor(p), st, bits=opt.bits)]
        chosen = path(opt, backend, group, block, scale)
        if opt.capturable:
            gi = next(i for i, g in enumerate(opt.param_groups) if g is group)
            pi = next(i for i, q in enumerate(group["params"]) if q is params[0])
            check_capturable(chosen, f"parameter {pi} of group {gi} (shape {tuple(params[0].shape)}, block {block})")
        out.append(Call(group, chosen, block, params, states, tiles))
    return out
