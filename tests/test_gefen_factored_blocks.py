"""Which blocks the factored second moment shares v in, beyond the default: with
``share_vector_second_moment`` a vector (norm gain, bias) in a factored group takes the published
rule's shared v (one block of the whole vector where the rule finds none) and no factor w, where by
default it keeps one v per element and a w; with ``share_matrix_rows`` a matrix in which the rule
finds no block shares v over whole rows, times the column factor, where by default it keeps one v
per element.

Independent references: the reference step (``reference.gefen_step``) run tensor by tensor, the
factored one on each tile of a matrix's rows (tiles restated here); an optimizer whose vectors sit
in a second, unfactored group; the block the published rule (``partition.choose_block``) and an
unfactored Gefen choose on the same gradient; ``torch.save``/``torch.load`` round trips.
"""

import copy
import math
import pickle

import pytest
import torch

from optim import Gefen, GefenLayout
from optim.gefen import distributed as D, reference as R, state as K
from optim.gefen.partition import choose_block
from tests.utils import (GEFEN_CPU_BACKENDS, assert_close, assert_copies_step_alike, assert_same_state,
                         checkpoint_and_continue,
                         row_scaled_grad, scaled_grad_steps, set_grads, small_params, step_side_by_side)

LR, WD, B1, B2 = 1e-2, 0.1, 0.9, 0.999
SHARE = "share_vector_second_moment"
# matrices (one tall: tiles of rows) and vectors: odd, even, prime (above MAX_BLOCK: no block the
# whole vector could fall back to) and one-element
SHAPES = [(24, 48), (30, 7), (256,), (160,), (1031,), (1,), (16, 96)]
VECTORS = [k for k, s in enumerate(SHAPES) if len(s) < 2]


def _runs(n, length=32):
    """Per-element scales in runs of ``length`` alike (e^3 and e^-3 in turn): the rule shares v over
    ``length`` where n allows it."""
    return torch.exp(3 * torch.tensor([(-1.0) ** (i // length) for i in range(n)]))


def _grads(steps, seed=0):
    """``steps`` lists of gradients: matrices with rows and columns of different scales; vectors
    N(0, 1) times runs of 32 alike (blocks for the rule)."""
    return scaled_grad_steps(SHAPES, steps, seed, vector=_runs)


def _params(seed=1):
    return small_params(SHAPES, seed)


def _square_tiles(shape, block):
    """Row ranges of a matrix's factor tiles, restated: with P > 1 and more rows than the row length
    C, tiles of C rows (C + 1 for odd C), the last one shorter; one tile otherwise."""
    c = math.prod(shape[1:])
    h = c + c % 2
    if block == 1 or shape[0] <= h:
        return [(0, shape[0])]
    return [(r, min(r + h, shape[0])) for r in range(0, shape[0], h)]


def _reference(start, steps, k, block, codebook, bits, bound=None):
    """The reference run of tensor ``k``: a vector unfactored (no w), a matrix factored tile by tile
    (``bound``: the reference's clip of m^, for a layout that bounds it).
    Returns (p, v, scales, codes) and w (None for a vector), tiles' state concatenated."""
    if start.dim() < 2:
        x, v, s, c = start.reshape(-1).float(), *R.init_state(start.numel(), block=block, bits=bits)
        for t, gs in enumerate(steps, 1):
            x, v, s, c = R.gefen_step(x, gs[k], v, s, c, codebook, step=t, lr=LR, beta1=B1, beta2=B2,
                                      eps=1e-8, weight_decay=WD, block=block, bits=bits, bound=bound)
        return (x, v, s, c), None
    row, parts = start.numel() // start.shape[0], []
    for r0, r1 in _square_tiles(tuple(start.shape), block):
        x = start.reshape(-1)[r0 * row:r1 * row].float()
        x, v, s, c = x, *R.init_state(x.numel(), block=block, bits=bits)
        w = torch.zeros(block)
        for t, gs in enumerate(steps, 1):
            g = gs[k].reshape(-1)[r0 * row:r1 * row]
            x, v, s, c, w = R.gefen_step(x, g, v, s, c, codebook, step=t, lr=LR, beta1=B1, beta2=B2,
                                         eps=1e-8, weight_decay=WD, block=block, bits=bits, w=w, bound=bound)
        parts.append((x, v, s, c, w))
    cat = [torch.cat(z) for z in zip(*parts)]
    return tuple(cat[:4]), cat[4]


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("kind", ["runs", "noise", "constant"])
def test_a_vector_takes_the_published_rules_block_and_no_w(kind, backend):
    """With the option a vector's state holds no w and one v a block of the length unfactored Gefen
    chooses on the same gradients where the rule finds a block (runs of 32 -> 32; one magnitude
    everywhere -> the provisional block, cut again by the rule at the first gradient that varies),
    and the whole vector where it finds none (N(0, 1): the rule says 1, the option 256); the matrix
    beside it keeps its factor. Without the option the vector keeps v per element and a one-element
    w, as before."""
    n = 256
    first = {"runs": torch.randn(n) * _runs(n), "noise": torch.randn(n),
             "constant": torch.full((n,), 0.5)}[kind]
    later = torch.randn(n) * _runs(n, 16)
    blocks = {}
    for name, groups in (("option", [{"params": None, "factor_second_moment": True, SHARE: True}]),
                         ("default", [{"params": None, "factor_second_moment": True}]),
                         ("unfactored", [{"params": None}])):
        vec, mat = torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(24, 48))
        opt = Gefen([dict(groups[0], params=[vec, mat])], layout="published", lr=LR, backend=backend)
        for g in (first, later):
            vec.grad, mat.grad = g.clone(), row_scaled_grad((24, 48), scale_columns=True)
            opt.step()
            blocks.setdefault(name, []).append(opt.state[vec][K.BLOCK])
        st = opt.state[vec]
        assert (K.W in st) == (name == "default"), name
        assert st[K.V].numel() * st[K.BLOCK] == n and (K.W in opt.state[mat]) == (name != "unfactored")
        if name == "default":
            assert st[K.BLOCK] == 1 and st[K.W].numel() == 1
    assert blocks["option"] == [b if b > 1 else n for b in blocks["unfactored"]], blocks
    if kind != "constant":
        assert blocks["unfactored"][0] == choose_block(first)
    assert blocks["option"] == {"runs": [32, 32], "noise": [256, 256], "constant": [64, 16]}[kind]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("backend", GEFEN_CPU_BACKENDS)
def test_vectors_step_as_the_unfactored_reference_and_matrices_as_the_factored(backend, bits):
    """8 steps on a model of matrices (one tall, in tiles) and vectors (blocks > 1, one P = 1 prime,
    one of one element): each vector follows the reference step without w, each matrix the
    factored reference on every tile. Codes equal the reference's exactly; scales, v and w to fp32
    rounding (sums in another order), p to 1e-6 (as the factored test holds every backend). And
    the whole model equals, bit for bit, an optimizer with the vectors in an unfactored group."""
    params, twins = _params(), _params()
    starts = [p.detach().clone() for p in params]
    opt = Gefen(params, lr=LR, weight_decay=WD, bits=bits, backend=backend,
                layout=GefenLayout(factor_second_moment=True, **{SHARE: True}))
    two = Gefen([{"params": [q for k, q in enumerate(twins) if k not in VECTORS], "factor_second_moment": True},
                 {"params": [twins[k] for k in VECTORS]}], layout="published", lr=LR, weight_decay=WD, bits=bits, backend=backend)
    steps = _grads(8)
    step_side_by_side([(opt, params), (two, twins)], steps)
    blocks = [opt.state[p][K.BLOCK] for p in params]
    assert [blocks[k] for k in VECTORS] == [32, 32, 1, 1], blocks
    for k, p in enumerate(params):
        st = opt.state[p]
        (x, v, s, c), w = _reference(starts[k], steps, k, blocks[k], opt.codebook, bits)
        assert (K.W in st) == (w is not None), SHAPES[k]
        assert torch.equal(st[K.CODES], c), f"codes of {SHAPES[k]} differ from the reference"
        assert_close(st[K.SCALES], s, rtol=1e-6, name="scales")
        assert_close(st[K.V], v, rtol=1e-5, name="v")
        if w is not None:
            assert_close(st[K.W], w, rtol=1e-5, name="w")
        assert_close(p.detach().reshape(-1), x, atol=1e-6, rtol=1e-6, name=f"p {SHAPES[k]}")
    assert torch.equal(opt.codebook, two.codebook)
    assert_same_state(opt, two, params, twins)


@pytest.mark.parametrize("backend", GEFEN_CPU_BACKENDS)
def test_a_vector_where_the_rule_finds_no_block_is_one_block(backend):
    """Gradients N(0, 1) (the rule says P = 1): with the option each vector is one block of its
    length (a prime, 97, and 256), holds no w, and 6 steps equal the unfactored reference step at
    that block length (codes exactly, p to 1e-6), the matrix beside them the factored one."""
    shapes = [(97,), (256,), (24, 48)]
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for s in shapes]
    starts = [p.detach().clone() for p in params]
    steps = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(6)]
    assert all(choose_block(steps[0][k]) == 1 for k in (0, 1))
    opt = Gefen(params, lr=LR, weight_decay=WD, layout=GefenLayout(factor_second_moment=True, **{SHARE: True}),
                backend=backend)
    for gs in steps:
        set_grads(params, gs)
        opt.step()
    assert [opt.state[p][K.BLOCK] for p in params[:2]] == [97, 256]
    for k, p in enumerate(params):
        st = opt.state[p]
        (x, v, s, c), w = _reference(starts[k], steps, k, st[K.BLOCK], opt.codebook, 8)
        assert (K.W in st) == (k == 2) and st[K.V].numel() == (1 if k < 2 else st[K.V].numel())
        assert torch.equal(st[K.CODES], c), f"codes of {shapes[k]} differ from the reference"
        assert_close(p.detach().reshape(-1), x, atol=1e-6, rtol=1e-6, name=f"p {shapes[k]}")


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_the_default_is_unchanged(backend):
    """Without the option a factored group is what it was: each vector has P = 1 and a one-element
    w, and 6 steps equal the reference run tensor by tensor (the vector's one-offset factor
    included, whose ratio is 1) as tightly as the factored test holds them, and bit for bit an
    optimizer with the option off by name."""
    params, twins = _params(), _params()
    starts = [p.detach().clone() for p in params]
    opt = Gefen(params, lr=LR, weight_decay=WD, layout="factored", backend=backend)
    off = Gefen(twins, lr=LR, weight_decay=WD, backend=backend,
                layout=GefenLayout(factor_second_moment=True, bound_first_moment=True, **{SHARE: False}))
    bound = R.moment_bound(B1, B2)  # the factored layout bounds m^
    assert opt.param_groups[0][SHARE] is False
    steps = _grads(6)
    step_side_by_side([(opt, params), (off, twins)], steps)
    assert_same_state(opt, off, params, twins)
    for k, p in enumerate(params):
        st = opt.state[p]
        if k in VECTORS:
            assert st[K.BLOCK] == 1 and st[K.W].numel() == 1
            x, v, s, c = starts[k].reshape(-1).float(), *R.init_state(p.numel(), block=1, bits=8)
            w = torch.zeros(1)
            for t, gs in enumerate(steps, 1):
                x, v, s, c, w = R.gefen_step(x, gs[k], v, s, c, opt.codebook, step=t, lr=LR, beta1=B1,
                                             beta2=B2, eps=1e-8, weight_decay=WD, block=1, bits=8, w=w, bound=bound)
        else:
            (x, v, s, c), w = _reference(starts[k], steps, k, st[K.BLOCK], opt.codebook, 8, bound)
        assert torch.equal(st[K.CODES], c), SHAPES[k]
        assert_close(st[K.V], v, rtol=1e-5, name="v")
        assert_close(st[K.W], w, rtol=1e-5, name="w")
        assert_close(p.detach().reshape(-1), x, atol=1e-6, rtol=1e-6, name=f"p {SHAPES[k]}")


def _make(share=True, backend="numba"):
    def make():
        ps = _params()
        return ps, Gefen([{"params": ps[:4], "factor_second_moment": True, SHARE: share}, {"params": ps[4:]}],
                         layout="published", lr=LR, weight_decay=WD, backend=backend)
    return make


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_state_dict_round_trip_resumes_bit_for_bit(tmp_path, backend):
    """A state dict saved after 3 steps (a vector with shared v and no w beside factored matrices)
    loads into a fresh optimizer, keeps the group's option, and 3 more steps equal the
    uninterrupted run bit for bit; so does a deepcopy and a pickle of the optimizer."""
    steps = _grads(6)
    params, opt, params2, opt2, saved = checkpoint_and_continue(_make(backend=backend), steps, tmp_path / "o.pt")
    assert saved["opt"]["param_groups"][0][SHARE] is True and saved["opt"]["param_groups"][1][SHARE] is False
    st = saved["opt"]["state"][2]
    assert K.W not in st and st[K.BLOCK] == 32
    assert opt2.param_groups[0][SHARE] is True
    assert_same_state(opt, opt2, params, params2)

    def keeps_the_option(twin):
        assert twin.param_groups[0][SHARE] is True and twin.defaults[SHARE] is False

    assert_copies_step_alike(opt, params, _grads(2, seed=7), check=keeps_the_option)


def test_a_pickle_from_before_the_option_has_it_off():
    """An optimizer pickled before the option existed (no key in its groups and defaults) gets it
    off, in every group and the defaults."""
    ps = _params()
    opt = Gefen(ps, layout="factored")
    state = opt.__getstate__()
    for g in state["param_groups"]:
        del g[SHARE]
    state["defaults"] = {k: v for k, v in state["defaults"].items() if k != SHARE}
    old = Gefen.__new__(Gefen)
    old.__setstate__(copy.deepcopy(state))
    assert old.param_groups[0][SHARE] is False and old.defaults[SHARE] is False


def test_a_checkpoint_from_before_the_option_loads_and_steps_as_before(tmp_path):
    """A state dict saved without the option's key (vectors with P = 1 and a one-element w in a
    factored group) loads into an optimizer built with the option: the saved group's setting
    (off, its old meaning) is restored, as factor_second_moment's is, the vectors keep their w,
    and 3 more steps equal the uninterrupted run of the default optimizer bit for bit."""
    steps = _grads(6)
    params, opt, _, _, saved = checkpoint_and_continue(_make(share=False), steps, tmp_path / "o.pt")
    sd = saved["opt"]
    for g in sd["param_groups"]:
        del g[SHARE]
    assert sd["state"][2][K.BLOCK] == 1 and sd["state"][2][K.W].numel() == 1
    params2, opt2 = _make(share=True)()
    with torch.no_grad():
        for p, q in zip(params2, saved["params"]):
            p.copy_(q)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0][SHARE] is False
    for gs in steps[3:]:
        set_grads(params2, gs)
        opt2.step()
    assert_same_state(opt, opt2, params, params2)


def test_a_state_its_group_does_not_describe_is_refused(tmp_path):
    """Loading: a vector holding w in a group with the option, a vector without w in a factored group
    without it, and a matrix without w in a group with it are refused, each naming the option
    that disagrees with the state. Stepping: the option switched in the group after the state
    exists is refused, either way."""
    steps = _grads(3)
    saved = {}
    for share in (True, False):
        params, opt = _make(share=share)()
        for gs in steps:
            set_grads(params, gs)
            opt.step()
        saved[share] = opt.state_dict()
    cases = [(True, lambda st: st[2].__setitem__(K.W, torch.zeros(1)),
              "holds a factor 'w'.*share_vector_second_moment=True"),
             (False, lambda st: st[2].pop(K.W), "holds no factor 'w'.*share_vector_second_moment=False"),
             (True, lambda st: st[0].pop(K.W), "holds no factor 'w'.*factor_second_moment=True")]
    for share, edit, match in cases:
        sd = copy.deepcopy(saved[share])
        edit(sd["state"])
        with pytest.raises(ValueError, match=match):
            _make(share=share)()[1].load_state_dict(sd)
    for share in (True, False):
        params, opt = _make(share=share)()
        opt.load_state_dict(copy.deepcopy(saved[share]))
        opt.param_groups[0][SHARE] = not share
        set_grads(params, steps[0])
        with pytest.raises(ValueError, match="share_vector_second_moment"):
            opt.step()


def test_the_option_is_a_flag():
    with pytest.raises(ValueError, match=SHARE):
        Gefen(_params(), layout=GefenLayout(factor_second_moment=True, **{SHARE: "yes"}))
    with pytest.raises(ValueError, match=SHARE):
        Gefen([{"params": _params(), SHARE: 1.5}], layout="published")


def test_the_distributed_form_holds_no_w_for_a_shared_vector():
    """The distributed (DCP) form of a state with the option round trips exactly in process and
    training continues bit for bit; a fresh optimizer's template (every key a checkpoint holds,
    before any step) has w for the matrices only, as the trained state does."""
    params, opt = _make(backend="torch")()
    for gs in _grads(3):
        set_grads(params, gs)
        opt.step()
    sd = opt.state_dict()
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    quantized = [True] * len(params)
    factored = D._factored(opt)
    assert factored == [True, True, False, False, False, False, False]
    dense = dict(sd, state=dict(sd["state"]))
    D.to_distributed(dense["state"], params, ids, quantized, codebook=opt.codebook, bits=8, factored=factored)
    assert [K.W in dense["state"][i] for i in ids] == factored
    template = {}
    D.to_distributed(template, params, ids, quantized, codebook=None, bits=8, factored=factored)
    assert [K.W in template[i] for i in ids] == factored
    params2, opt2 = _make(backend="torch")()
    with torch.no_grad():
        for p, q in zip(params2, params):
            p.copy_(q)
    opt2.load_state_dict(dense)
    for p, q in zip(params, params2):
        assert opt.state[p].keys() == opt2.state[q].keys()
        for key, val in opt.state[p].items():
            assert torch.equal(val, opt2.state[q][key]) if torch.is_tensor(val) else val == opt2.state[q][key], key
    for gs in _grads(2, seed=3):
        set_grads(params, gs)
        set_grads(params2, gs)
        opt.step()
        opt2.step()
    assert_same_state(opt, opt2, params, params2)


@pytest.mark.parametrize("backend", GEFEN_CPU_BACKENDS)
def test_a_matrix_where_the_rule_finds_no_block_shares_whole_rows(backend):
    """A (16, 97) matrix, whose few candidate blocks the rule turns down on N(0, 1) gradients
    (P = 1): with ``share_matrix_rows`` it shares v over whole rows (block 97) and keeps its
    column factor, and 6 steps equal the factored reference at that block (codes exactly, p to
    1e-6); without it, one v per element, as before (block 1). A matrix where the rule finds a
    block keeps it either way."""
    gen = torch.Generator().manual_seed(4)
    shapes = [(16, 97), (24, 48)]
    steps = [[torch.randn(shapes[0], generator=gen), row_scaled_grad(shapes[1], scale_columns=True)]
             for _ in range(6)]
    assert choose_block(steps[0][0]) == 1
    blocks = {}
    for rows in (False, True):
        params = [torch.nn.Parameter(0.1 * torch.randn(s, generator=torch.Generator().manual_seed(5))) for s in shapes]
        starts = [p.detach().clone() for p in params]
        opt = Gefen(params, lr=LR, weight_decay=WD,
                    layout=GefenLayout(factor_second_moment=True, share_matrix_rows=rows), backend=backend)
        for gs in steps:
            set_grads(params, gs)
            opt.step()
        blocks[rows] = [opt.state[p][K.BLOCK] for p in params]
        for k, p in enumerate(params):
            st = opt.state[p]
            (x, v, s, c), w = _reference(starts[k], steps, k, st[K.BLOCK], opt.codebook, 8)
            assert K.W in st and torch.equal(st[K.CODES], c), f"codes of {shapes[k]} differ from the reference"
            assert_close(st[K.W], w, rtol=1e-5, name="w")
            assert_close(p.detach().reshape(-1), x, atol=1e-6, rtol=1e-6, name=f"p {shapes[k]}")
    assert blocks[False][0] == 1 and blocks[True][0] == 97
    assert blocks[False][1] == blocks[True][1] > 1


def test_share_matrix_rows_is_a_flag_kept_in_the_groups():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="share_matrix_rows"):
        Gefen([p], layout=GefenLayout(factor_second_moment=True, share_matrix_rows="yes"))
    opt = Gefen([p], layout=GefenLayout(factor_second_moment=True, share_matrix_rows=True))
    assert opt.param_groups[0]["share_matrix_rows"] and opt.state_dict()["param_groups"][0]["share_matrix_rows"]
    old = pickle.loads(pickle.dumps(opt))
    del old.param_groups[0]["share_matrix_rows"], old.defaults["share_matrix_rows"]
    old.__setstate__(old.__dict__)
    assert old.param_groups[0]["share_matrix_rows"] is False
