"""Gefen's step plan follows the Parameter objects in ``param_groups`` and the layout of their data.

A plan is keyed by what its launches depend on (``plan.signature``): a Parameter re-wrapped on the
same storage and put back into its group is another Parameter (as in torch, ``opt.state`` is keyed
by the object: the new one starts with no state, at step 1, unless its state is moved to it), and
a parameter whose data is transposed or re-strided at the same address is stepped in its new
layout (element (i, j) with gradient (i, j) and the state of (i, j), as AdamW steps it).

References: ``torch.optim.AdamW`` on a copy of the model through the same changes (Gefen with
``share_second_moment=False, quantize_first_moment=False`` is AdamW: max |Δ| <= 1e-6, as in
tests/test_gefen_plan.py), and for the default layout the reference step (``reference.gefen_step``)
on each tensor's elements in their logical order (a factored matrix's tiles each as a tensor of
their own), with the blocks and codebook the optimizer chose: codes exactly, parameters to 1e-6
(fp32 rounding of the compiled steps)."""

import copy

import pytest
import torch

from optim import Gefen
from optim.backends import numba_available
from optim.gefen import reference as R, state as K
from tests.utils import assert_close, row_scaled_grad, set_grads

ADAMW = dict(layout="adamw")
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.999), 1e-8
BACKENDS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(not numba_available(), reason="no numba")),
            "triton"]
# zero_grad(set_to_none=False) keeps a row-major gradient for a transposed parameter, as meant here
pytestmark = pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")


def _pair(backend):
    """A small model and a copy, stepped by Gefen as AdamW and by ``torch.optim.AdamW``."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    twin = copy.deepcopy(model)
    ours = Gefen(model.parameters(), lr=LR, weight_decay=WD, backend=backend, **ADAMW)
    ref = torch.optim.AdamW(twin.parameters(), lr=LR, weight_decay=WD, foreach=False)
    return [(model, ours), (twin, ref)]


def _train(pairs, x, steps, set_to_none):
    for _ in range(steps):
        for model, opt in pairs:
            opt.zero_grad(set_to_none=set_to_none)
            model(x).square().sum().backward()
            opt.step()


def _assert_same(pairs, what):
    (model, _), (twin, _) = pairs
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p.detach(), q.detach(), atol=1e-6, name=f"{what}: {name}")


def _rewrap(model, opt, how, keep_state):
    """``model[2].weight`` re-wrapped on its storage and put back in the group in its place;
    ``keep_state``: its state moved to the new Parameter too."""
    old = model[2].weight
    new = torch.nn.Parameter(old.data) if how == "data" else torch.nn.Parameter(old.to(old.device))
    assert new is not old and new.data_ptr() == old.data_ptr()
    model[2].weight = new
    params = opt.param_groups[0]["params"]
    params[next(i for i, p in enumerate(params) if p is old)] = new
    if keep_state:
        opt.state[new] = opt.state.pop(old)
    return new


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("set_to_none", [True, False], ids=["zero_grad", "zero_grad_keep"])
@pytest.mark.parametrize("how,keep_state", [("data", False), ("to", False), ("data", True)],
                         ids=["Parameter(w.data)", "Parameter(w.to(device))", "state_moved"])
def test_rewrapped_parameter_is_stepped_with_its_own_gradient(backend, set_to_none, how, keep_state):
    """Two steps, ``model[2].weight`` re-wrapped (same storage), three more: every parameter as
    AdamW's; the new Parameter's step count as AdamW's (3: fresh state; 5 where its state was
    moved to it). A plan for the old Parameter would step it on its stale (or zeroed, or absent)
    gradient and leave the new one's unread."""
    pairs = _pair(backend)
    x = torch.randn(5, 10)
    _train(pairs, x, 2, set_to_none)
    new = [_rewrap(model, opt, how, keep_state) for model, opt in pairs]
    _train(pairs, x, 3, set_to_none)
    _assert_same(pairs, "after the re-wrap")
    (_, ours), (_, ref) = pairs
    assert ours.state[new[0]][K.STEP] == int(ref.state[new[1]]["step"]) == (5 if keep_state else 3)


def _restride(p, how):
    """``p.data`` at the same address in another layout: transposed (square), or column-major."""
    ptr = p.data_ptr()
    if how == "transposed":
        p.data = p.data.t()
    else:
        p.data = p.data.as_strided(p.shape, (1, p.shape[0]))
    assert p.data_ptr() == ptr and not p.is_contiguous()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("set_to_none", [True, False], ids=["zero_grad", "zero_grad_keep"])
@pytest.mark.parametrize("how", ["transposed", "as_strided"])
def test_transposed_parameter_is_updated_in_its_own_layout(backend, set_to_none, how):
    """Two steps, a weight's data transposed (the square (8, 8)) or re-strided column-major (the
    (8, 10)) at the same address, on both models, three more: every parameter as AdamW's. With
    ``zero_grad(set_to_none=False)`` the gradient keeps its row-major layout: a launch built for
    the contiguous parameter would step memory element k with gradient element k, so that (i, j)
    gets the update of (j, i)."""
    pairs = _pair(backend)
    x = torch.randn(5, 10)
    _train(pairs, x, 2, set_to_none)
    for model, _ in pairs:
        _restride(model[2].weight if how == "transposed" else model[0].weight, how)
    _train(pairs, x, 3, set_to_none)
    _assert_same(pairs, f"after the parameter was {how}")


# ------------------------------------------------------------------ default layout, reference step
SHAPES = [(16, 16), (12, 20), (40,)]
CHANGE_AT = 3  # the step before which the change is made


def _reference(starts, grads, blocks, codebook, change, restart=()):
    """Each tensor stepped by ``reference.gefen_step`` on its elements in logical order; before
    step ``CHANGE_AT`` ``change(k, x)`` gives tensor k's new logical values, and the tensors in
    ``restart`` (re-wrapped) start again from fresh state, with the block of ``blocks[k][1]``."""
    out = []
    for k, x in enumerate(starts):
        state, t0 = R.init_state(x.numel(), block=blocks[k][0], bits=8), 0
        for t, gs in enumerate(grads, 1):
            block = blocks[k][0]
            if t == CHANGE_AT:
                x = change(k, x)
                if k in restart:
                    state, t0 = R.init_state(x.numel(), block=blocks[k][1], bits=8), t - 1
            if k in restart and t >= CHANGE_AT:
                block = blocks[k][1]
            flat, *state = R.gefen_step(x.reshape(-1), gs[k].reshape(-1), *state, codebook, step=t - t0, lr=LR,
                                        beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, block=block, bits=8)
            x = flat.reshape(x.shape)
        out.append((x, state[2]))
    return out


def _assert_reference(opt, reference):
    for k, (p, (x, codes)) in enumerate(zip(opt.param_groups[0]["params"], reference)):
        assert torch.equal(opt.state[p][K.CODES], codes), f"tensor {k}: codes differ from the reference"
        assert_close(p.detach(), x, atol=1e-6, rtol=1e-6, name=f"tensor {k}")


def _default_run(backend, change_params):
    """Five steps of Gefen's default layout on ``SHAPES`` with rows of other scales (blocks > 1);
    ``change_params(params)`` (the group's list) before step ``CHANGE_AT``."""
    params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in SHAPES]
    starts = [p.detach().clone() for p in params]
    opt = Gefen(params, layout="published", lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, backend=backend)
    grads = [[row_scaled_grad(s) for s in SHAPES] for _ in range(5)]
    for t, gs in enumerate(grads, 1):
        if t == CHANGE_AT:
            change_params(opt.param_groups[0]["params"])
        set_grads(opt.param_groups[0]["params"], gs)
        opt.step()
    return opt, starts, grads


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_parameter_matches_the_reference_in_the_default_layout(backend):
    """Gefen's default layout (shared v, 8-bit codes): the square matrix transposed and the
    (12, 20) one re-strided column-major before step 3; the reference steps each tensor's logical
    elements with the same blocks and codebook, its state following the logical index."""
    def change_params(params):
        _restride(params[0], "transposed")
        _restride(params[1], "as_strided")

    def change(k, x):
        return x.t() if k == 0 else x.as_strided(x.shape, (1, x.shape[0])) if k == 1 else x

    opt, starts, grads = _default_run(backend, change_params)
    blocks = [(opt.state[p][K.BLOCK],) for p in opt.param_groups[0]["params"]]
    assert max(b for b, in blocks) > 1, blocks
    _assert_reference(opt, _reference(starts, grads, blocks, opt.codebook, change))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rewrapped_parameter_starts_fresh_in_the_default_layout(backend):
    """The (16, 16) matrix re-wrapped on its storage before step 3 and put back in the group: the
    new Parameter starts from fresh state at its step 1, its block chosen again from its first
    gradient, stepped with the same codebook; the old one's state is left as it was after step 2."""
    old = []

    def change_params(params):
        old.append(params[0])
        params[0] = torch.nn.Parameter(params[0].data)

    opt, starts, grads = _default_run(backend, change_params)
    params = opt.param_groups[0]["params"]
    assert opt.state[params[0]][K.STEP] == len(grads) - CHANGE_AT + 1 and opt.state[old[0]][K.STEP] == CHANGE_AT - 1
    blocks = [(opt.state[q][K.BLOCK], opt.state[p][K.BLOCK]) for q, p in zip([old[0], *params[1:]], params)]
    _assert_reference(opt, _reference(starts, grads, blocks, opt.codebook, lambda k, x: x, restart=(0,)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_restrided_factored_matrix_is_stepped_tile_by_tile_in_its_own_layout(backend):
    """``factor_second_moment``: a (24, 6) matrix (blocks of a row) is stepped in four tiles of 6
    rows, each with its own factor w, the tiles being views of its rows. Re-strided column-major
    before step 3, it is stepped on the rows of its new layout: the reference steps each tile's
    logical rows as a tensor of its own (as tests/test_gefen_factored.py does), codes and w
    exactly as there, parameters to 1e-6. Tile views kept from the row-major layout would step
    other elements on every backend."""
    shape, rows = (24, 6), 6
    p = torch.nn.Parameter(torch.randn(shape) * 0.1)
    x = p.detach().clone()
    opt = Gefen([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, layout="factored", backend=backend)
    grads = [row_scaled_grad(shape, scale_columns=True) for _ in range(5)]
    for t, g in enumerate(grads, 1):
        if t == CHANGE_AT:
            _restride(p, "as_strided")
        p.grad = g.clone()
        opt.step()
    st = opt.state[p]
    block = st[K.BLOCK]
    assert block == shape[1] and st[K.W].numel() == block * shape[0] // rows, (block, st[K.W].numel())
    tiles = [[*R.init_state(rows * shape[1], block=block, bits=8), torch.zeros(block)] for _ in range(shape[0] // rows)]
    for t, g in enumerate(grads, 1):
        if t == CHANGE_AT:
            x = x.as_strided(shape, (1, shape[0]))
        parts = []
        for k, state in enumerate(tiles):
            r = slice(k * rows, (k + 1) * rows)
            flat, *state[:] = R.gefen_step(x[r].reshape(-1), g[r].reshape(-1), *state[:3], opt.codebook, step=t, lr=LR,
                                           beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, block=block,
                                           bits=8, w=state[3], bound=R.moment_bound(*BETAS))
            parts.append(flat)
        x = torch.cat(parts).reshape(shape)
    assert torch.equal(st[K.CODES], torch.cat([s[2] for s in tiles])), "codes differ from the reference"
    assert_close(st[K.W], torch.cat([s[3] for s in tiles]), rtol=1e-5, name="w")
    assert_close(p.detach(), x, atol=1e-6, rtol=1e-6, name="p")
