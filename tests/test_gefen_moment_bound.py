"""The first-moment bound (``bound_first_moment``): no element of Gefen moves more than AdamW could.

* ``reference.moment_bound`` against ``torch.optim.AdamW``'s own moments: on random gradient streams
  (heavy-tailed, sparse, constant) no ``|exp_avg| / sqrt(exp_avg_sq)`` exceeds it, and the stream that
  attains Cauchy-Schwarz's equality comes within 1% of it;
* on torch, numba and Triton (interpreted), every layout that bounds m^ (factored and compact, 8 and 4
  bits): elements whose gradient is always zero (an embedding's unseen tokens, a column no input
  reaches) move exactly as AdamW moves them (weight decay only), and no element of rows with gradients from 1e-6 to 1 moves more than the
  bound's ``bound * sqrt(1 - beta2**t) / (1 - beta1**t)`` lr a step; the published layout, which does
  not bound m^, moves both far more on the same input (so the check can fail);
* each backend equals ``reference.gefen_step`` with the bound on a tensor where it clips.
"""

from __future__ import annotations

import math

import pytest
import torch

from optim import Gefen
from optim.gefen import reference
from optim.gefen.layout import layout_of

BETAS = (0.9, 0.999)
LR, WD = 1e-3, 0.1
BOUNDED = [("factored", 8), ("factored", 4), ("compact", 8), ("compact", 4)]
BACKENDS = ("torch", "numba", "triton")


def _adamw_ratios(grads, betas):
    """|exp_avg| / sqrt(exp_avg_sq) of torch.optim.AdamW after each gradient of ``grads`` (steps x n)."""
    p = torch.nn.Parameter(torch.zeros(grads.shape[1], dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=betas, weight_decay=0.0)
    out = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        st = opt.state[p]
        v = st["exp_avg_sq"]
        out.append(torch.where(v > 0, st["exp_avg"].abs() / v.sqrt(), torch.zeros_like(v)))
    return torch.stack(out)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.95, 0.99), (0.5, 0.9), (0.0, 0.98)])
def test_bound_holds_for_adamw_and_is_tight(betas):
    b1, b2 = betas
    bound = reference.moment_bound(b1, b2)
    gen = torch.Generator().manual_seed(7)
    steps = 400
    streams = torch.cat([
        torch.randn(steps, 64, generator=gen, dtype=torch.float64),  # Gaussian
        torch.randn(steps, 64, generator=gen, dtype=torch.float64) ** 5,  # heavy-tailed
        torch.randn(steps, 64, generator=gen, dtype=torch.float64) * (torch.rand(steps, 64, generator=gen,
                                                                                  dtype=torch.float64) < 0.05),
        torch.ones(steps, 1, dtype=torch.float64),  # constant
    ], dim=1)
    assert _adamw_ratios(streams, betas).max().item() <= bound * (1 + 1e-9)
    # equality of Cauchy-Schwarz: g_{t-k} proportional to (b1 / b2)**k, the newest last
    k = torch.arange(steps - 1, -1, -1, dtype=torch.float64)
    extreme = ((b1 / b2) ** k).unsqueeze(1)
    assert _adamw_ratios(extreme, betas)[-1].item() == pytest.approx(bound, rel=1e-2)


def test_no_bound_where_adamw_has_none():
    assert reference.moment_bound(0.9, 0.81) == math.inf  # beta1**2 == beta2: |m| / sqrt(v) grows with t
    assert reference.moment_bound(0.9, 1.0) == math.inf
    assert reference.moment_bound(0.0, 0.999) == pytest.approx(1 / math.sqrt(0.001))


def _rows(steps, seed):
    """Gradients of a (48, 128) table: rows 0-15 every step at row scales 1e-6 .. 1, rows 16-31 at the
    first step only, rows 32-47 and columns 120-127 never (zero: ``UNTOUCHED``)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-6, 0, 16, dtype=torch.float32).unsqueeze(1)
    for t in range(steps):
        g = torch.zeros(48, 128)
        g[:16] = torch.randn(16, 128, generator=gen) * scale
        if t == 0:
            g[16:32] = torch.randn(16, 128, generator=gen) * scale
        g[UNTOUCHED] = 0
        yield g


UNTOUCHED = torch.zeros(48, 128, dtype=torch.bool)
UNTOUCHED[32:] = True
UNTOUCHED[:, 120:] = True


def _caps(grads, block, factored=True):
    """Brute force in float64 over the gradient history of a (48, 128) table stepped as one tensor
    in blocks of ``block`` (``factored``: one column factor): after each step, each element's
    (u, v~): u the least bound on AdamW's own second moment that a block's and an offset's mean
    squares give, ``min(P v_b, n_b w_j)`` (``P v_b`` without a factor, v itself at block 1), and v~
    the second moment the step divides by (``v_b w_j / mean(w)``, or ``v_b``)."""
    b2 = BETAS[1]
    v_b = w = 0.0
    for g in grads:
        sq = g.double().reshape(-1, block) ** 2
        v_b = b2 * v_b + (1 - b2) * sq.mean(dim=1, keepdim=True)
        w = b2 * w + (1 - b2) * sq.mean(dim=0, keepdim=True)
        if block == 1:
            yield v_b, v_b
            continue
        u, est = block * v_b.expand_as(sq), v_b.expand_as(sq)
        if factored:
            u = torch.minimum(u, sq.shape[0] * w)
            est = torch.where(w.mean() > 0, v_b * w / w.mean(), v_b)
        yield u, est


def _steps_and_limits(layout, bits, backend, steps=12):
    """Per step: (|step| / lr of each element less weight decay, the largest the bound lets it take:
    ``bound * sqrt(u / v~) * sqrt(1 - beta2**t) / (1 - beta1**t)`` from ``_caps``, 0 where u is 0);
    then the never-touched elements at the end, and AdamW's."""
    start = torch.randn(48, 128, generator=torch.Generator().manual_seed(3))
    p = torch.nn.Parameter(start.clone())
    q = torch.nn.Parameter(start.clone())
    opt = Gefen([p], lr=LR, betas=BETAS, weight_decay=WD, layout=layout, bits=bits, backend=backend)
    adamw = torch.optim.AdamW([q], lr=LR, betas=BETAS, weight_decay=WD)
    grads = list(_rows(steps, seed=5))
    moves = []
    for g in grads:
        before = p.detach().clone()
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
        moves.append(((p.detach() - before * (1 - LR * WD)).abs() / LR).reshape(-1))
    st = opt.state[p]
    assert st.get("w") is None or st["w"].numel() == st["block"]  # one tensor, one factor: _caps's model
    b1, b2 = BETAS
    limits = []
    for t, (u, est) in enumerate(_caps(grads, st["block"], st.get("w") is not None), start=1):
        ratio = torch.where(u > 0, (u / est).sqrt(), torch.zeros_like(u)).reshape(-1)
        limits.append(reference.moment_bound(b1, b2) * ratio * math.sqrt(1 - b2**t) / (1 - b1**t))
    return moves, limits, p.detach()[UNTOUCHED], q.detach()[UNTOUCHED]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout, bits", BOUNDED)
def test_bounded_layouts_move_no_element_more_than_the_bound_lets_them(layout, bits, backend):
    assert layout_of(layout, bits).bound_first_moment
    moves, limits, untouched, adamw_untouched = _steps_and_limits(layout, bits, backend)
    for t, (move, limit) in enumerate(zip(moves, limits), start=1):
        excess = move - (limit * (1 + 1e-2) + 1e-3)
        assert excess.max() <= 0, (t, move[excess.argmax()].item(), limit[excess.argmax()].item())
    torch.testing.assert_close(untouched, adamw_untouched, rtol=2e-7, atol=0)


@pytest.mark.parametrize("bits", [8, 4])
def test_without_the_bound_the_same_rows_move_far_more(bits):
    """The compact layout less the bound (its scale blocks span rows, so a row no gradient reached
    is stored as the smallest entry times its neighbours' scale) and the published layout (which
    has none) move the untouched elements; the compact one also far past the limit."""
    unbounded = layout_of("compact", bits).replace(bound_first_moment=False)
    moves, limits, untouched, adamw_untouched = _steps_and_limits(unbounded, bits, "torch")
    assert max((m - l).max().item() for m, l in zip(moves, limits)) > 100
    assert not torch.allclose(untouched, adamw_untouched)
    assert not layout_of("published", bits).bound_first_moment
    untouched, adamw_untouched = _steps_and_limits("published", bits, "torch")[2:]
    assert not torch.allclose(untouched, adamw_untouched)


@pytest.mark.parametrize("backend", ("torch", "numba"))
@pytest.mark.parametrize("layout, bits", BOUNDED)
def test_the_bound_never_clips_adamws_own_moment(layout, bits, backend):
    """With the first moment unquantised (AdamW's own m) the bound changes no step, on rows whose
    row-by-column estimate is far below some elements' own v: a clip to the estimate would act."""
    grads = list(_rows(12, seed=9))
    out = []
    for bound in (True, False):
        chosen = layout_of(layout, bits).replace(quantize_first_moment=False, bound_first_moment=bound)
        p = torch.nn.Parameter(torch.randn(48, 128, generator=torch.Generator().manual_seed(4)))
        opt = Gefen([p], lr=LR, betas=BETAS, weight_decay=WD, layout=chosen, backend=backend)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out.append(p.detach().clone())
    assert torch.equal(out[0], out[1])
    # AdamW's own moments on the same rows exceed bound * sqrt(estimate) (float64, brute force)
    m = torch.zeros(48, 128, dtype=torch.float64)
    over = 0.0
    for g, (_, est) in zip(grads, _caps(grads, 128)):
        m.lerp_(g.double(), 1 - BETAS[0])
        over = max(over, (m.abs() / est.sqrt().clamp_min(1e-300)).max().item())
    assert over > reference.moment_bound(*BETAS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("factored", [False, True])
def test_backends_equal_the_reference_where_the_bound_clips(backend, factored):
    """One (48, 128) tensor, one step after a first, on rows of very different scale: factored, one
    block a row (P = 128) and a column factor; else one v an element in chunks of two rows. The
    reference's step with the bound, and the clip must act (it differs without it)."""
    layout = (layout_of("factored") if factored else
              layout_of("published").replace(share_second_moment=False, bound_first_moment=True))
    start = torch.randn(48, 128, generator=torch.Generator().manual_seed(11))
    p = torch.nn.Parameter(start.clone())
    opt = Gefen([p], lr=LR, betas=BETAS, weight_decay=WD, layout=layout, backend=backend)
    grads = list(_rows(2, seed=13))
    p.grad = grads[0].clone()
    opt.step()
    st = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
    before = p.detach().clone()
    p.grad = grads[1].clone()
    opt.step()
    cb = opt._codebook.values
    kw = dict(step=2, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=1e-8, weight_decay=WD, block=st["block"], bits=8,
              w=st.get("w"), scale=None if "scale_block" not in st else st["scale_block"])
    ref = reference.gefen_step(before, grads[1], st["v"], st["scales"], st["codes"], cb,
                               bound=reference.moment_bound(*BETAS), **kw)[0]
    unclipped = reference.gefen_step(before, grads[1], st["v"], st["scales"], st["codes"], cb, **kw)[0]
    assert not torch.allclose(ref, unclipped)
    torch.testing.assert_close(p.detach().reshape(-1), ref, rtol=1e-5, atol=1e-7)
