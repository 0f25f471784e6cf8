"""Two layout options of the factored second moment that cut its bytes: ``row_group_scales`` (one
first-moment scale per group of a matrix's whole rows of at most 2,048 elements, or of an int's
elements, instead of one per row) and ``whole_matrix_factor`` (one column factor per matrix instead of one per square tile of rows).

Independent references: the scale-block length restated here by brute force over the multiples of
the block; the reference step (``reference.gefen_step``) run tile by tile with that scale length; a
state dict round trip against the uninterrupted run; state dicts and groups edited apart.
"""

import copy
import math

import pytest
import torch

from optim import Gefen, GefenLayout
from optim.gefen import reference as R, state as K
from tests.utils import (assert_close, assert_copies_step_alike, assert_same_state, checkpoint_and_continue,
                         scaled_grad_steps, set_grads, small_params)

LR, WD, B1, B2 = 1e-2, 0.1, 0.9, 0.999
MOST = 2048  # the longest scale block of row groups, in elements (Gefen-X's fallback block length)
# one tile (rows <= C), square tiles with a short last one (100 rows of 20: tiles of 20), odd C (tiles
# of C + 1 rows), a tall matrix whose tiles' rows share few divisors, and rows of which no two fit in
# MOST elements (9 rows of 1,000, odd: the scale stays one a row)
SHAPES = [(24, 48), (100, 20), (30, 7), (70, 16), (9, 1000)]


def _grads(steps, seed=0):
    """Gradients whose rows differ in scale and columns too: the published rule shares v along whole
    rows, so P is the row length."""
    return scaled_grad_steps(SHAPES, steps, seed)


def _params(seed=1):
    return small_params(SHAPES, seed)


def _tiles(shape, block, whole):
    """Row ranges of a matrix's factor tiles, restated: square tiles of C rows (C + 1 for odd C)
    where P > 1 and there are more rows than that, unless one factor serves the whole matrix."""
    c = math.prod(shape[1:])
    h = c + c % 2
    if block == 1 or shape[0] <= h or whole:
        return [(0, shape[0])]
    return [(r, min(r + h, shape[0])) for r in range(0, shape[0], h)]


def _scale_length(shape, block, whole, most=MOST):
    """The longest multiple of P, at most ``most`` elements (at least P), dividing every tile's elements."""
    row = math.prod(shape[1:])
    sizes = [(r1 - r0) * row for r0, r1 in _tiles(shape, block, whole)]
    return max(k * block for k in range(1, max(1, most // block) + 1) if all(n % (k * block) == 0 for n in sizes))


def _reference(start, steps, k, block, scale, codebook, bits, whole):
    """Tensor ``k`` stepped tile by tile by the reference step with scale blocks of ``scale``:
    (p, v, scales, codes, w), tiles' state concatenated."""
    row, parts = start.numel() // start.shape[0], []
    for r0, r1 in _tiles(tuple(start.shape), block, whole):
        x = start.reshape(-1)[r0 * row:r1 * row].float()
        x, v, s, c = x, *R.init_state(x.numel(), block=block, bits=bits, scale=scale)
        w = torch.zeros(block)
        for t, gs in enumerate(steps, 1):
            g = gs[k].reshape(-1)[r0 * row:r1 * row]
            x, v, s, c, w = R.gefen_step(x, g, v, s, c, codebook, step=t, lr=LR, beta1=B1, beta2=B2, eps=1e-8,
                                         weight_decay=WD, block=block, bits=bits, w=w, scale=scale)
        parts.append((x, v, s, c, w))
    return [torch.cat(z) for z in zip(*parts)]


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("scales, whole", [(True, False), (False, True), (True, True), (300, True), (64, False)])
def test_steps_equal_the_reference_with_row_group_scales_and_one_factor_a_matrix(scales, whole, bits, backend):
    """6 steps of each option alone and both together, and groups bounded by an int of elements:
    every matrix keeps P = its row, its scales one per scale block of the restated length (fewer than
    rows where a group of rows fits), its w
    one per tile (one a matrix with ``whole_matrix_factor``), and codes, scales, v and w equal the
    reference stepped tile by tile with that scale length (codes exactly, the rest to 1e-6)."""
    steps = _grads(6)
    params = _params()
    starts = [p.detach().clone() for p in params]
    opt = Gefen(params, lr=LR, weight_decay=WD, bits=bits,
                layout=GefenLayout(factor_second_moment=True, row_group_scales=scales, whole_matrix_factor=whole),
                backend=backend)
    for gs in steps:
        set_grads(params, gs)
        opt.step()
    grouped = 0
    for k, p in enumerate(params):
        st, shape = opt.state[p], tuple(p.shape)
        block = st[K.BLOCK]
        assert block == shape[1], f"{shape}: the rule should share v along whole rows, got P = {block}"
        scale = _scale_length(shape, block, whole, MOST if scales is True else scales) if scales else block
        grouped += scale > block
        assert st[K.SCALES].numel() == p.numel() // scale
        assert st[K.W].numel() == len(_tiles(shape, block, whole)) * block
        x, v, s, c, w = _reference(starts[k], steps, k, block, scale, opt.codebook, bits, whole)
        assert torch.equal(st[K.CODES], c), f"codes of {shape} differ from the reference"
        assert_close(st[K.SCALES], s, rtol=1e-6, name=f"scales {shape}")
        assert_close(st[K.V], v, rtol=1e-6, name=f"v {shape}")
        assert_close(st[K.W], w, rtol=1e-6, name=f"w {shape}")
        assert_close(p.detach().reshape(-1), x, atol=1e-6, rtol=1e-6, name=f"p {shape}")
    assert grouped >= 3 if scales else grouped == 0


def test_the_options_cut_the_bytes_they_say():
    """State bytes after one step of a (512, 128) matrix: the default's 1 + 4/C (scale) + 4/C (v) +
    4 C tiles / numel (w) per element; row_group_scales makes the scales 4 per 2,048 elements (per
    256 given 256), and whole_matrix_factor the factor one row of C floats."""
    p = torch.nn.Parameter(torch.zeros(512, 128))
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(512, 128, generator=gen) * torch.exp(2 * torch.randn(512, 1, generator=gen))
    per = {}
    for scales, whole in [(False, False), (True, False), (False, True), (True, True), (256, True)]:
        opt = Gefen([p], layout=GefenLayout(factor_second_moment=True, row_group_scales=scales,
                                            whole_matrix_factor=whole))
        p.grad = grad.clone()
        opt.step()
        per[scales, whole] = sum(t.numel() * t.element_size() for t in opt.state[p].values() if torch.is_tensor(t))
    n = 512 * 128
    assert per[False, False] == n + 4 * 512 + 4 * 512 + 4 * 4 * 128
    assert per[True, False] == n + 4 * 512 // 16 + 4 * 512 + 4 * 4 * 128
    assert per[False, True] == n + 4 * 512 + 4 * 512 + 4 * 128
    assert per[True, True] == n + 4 * 32 + 4 * 512 + 4 * 128
    assert per[256, True] == n + 4 * 256 + 4 * 512 + 4 * 128


@pytest.mark.parametrize("value", [0, -5, 2.5, "yes", None, 2048.0])
def test_row_group_scales_takes_a_flag_or_a_positive_int(value):
    """Anything but True, False or an int >= 1 is refused when the optimizer is made, and when a
    group is added."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="row_group_scales"):
        Gefen([p], layout=GefenLayout(factor_second_moment=True, row_group_scales=value))
    opt = Gefen([p], layout=GefenLayout(factor_second_moment=True, row_group_scales=16))
    with pytest.raises(ValueError, match="row_group_scales"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], "row_group_scales": value})


@pytest.mark.parametrize("bits", [8, 4])
def test_every_backend_steps_row_group_scales(bits):
    """On the CPU 'auto' steps a group with row_group_scales on numba (its plan's path), bitwise the
    explicit numba backend; the Triton step (its interpreter here) takes such a group on its own path
    (the (30, 7) matrix, odd P at 4 bits, excepted: the torch step's) and holds the torch step's
    scales and codes exactly, v and w to fp32 rounding (the kernel sums g**2 in another order)."""
    steps = _grads(3)
    runs = {}
    for name in ("auto", "numba", "triton", "torch"):
        params = _params()
        opt = Gefen(params, lr=LR, weight_decay=WD, bits=bits,
                    layout=GefenLayout(factor_second_moment=True, row_group_scales=True),
                    backend=name)
        for gs in steps:
            set_grads(params, gs)
            opt.step()
        runs[name] = (params, opt)
    paths = {name: [o._path_of(p, o.param_groups[0], o._backends[p].backend) for p in ps]
             for name, (ps, o) in runs.items()}
    assert set(paths["auto"]) == set(paths["numba"]) == {"numba"}
    assert paths["triton"] == ["triton" if bits == 8 or p.shape[1] % 2 == 0 else "torch" for p in runs["triton"][0]]
    assert_same_state(runs["auto"][1], runs["numba"][1], runs["auto"][0], runs["numba"][0])
    (pt, ot), (pr, orf) = runs["triton"], runs["torch"]
    for p, q in zip(pt, pr):
        a, b = ot.state[p], orf.state[q]
        assert K.scale_length(a) == K.scale_length(b)
        assert torch.equal(a[K.SCALES], b[K.SCALES]) and torch.equal(a[K.CODES], b[K.CODES]), tuple(p.shape)
        for key in (K.V, K.W):
            assert_close(a[key], b[key], rtol=1e-5, name=f"{key} {tuple(p.shape)}")
        assert_close(p, q, atol=1e-5, name=str(tuple(p.shape)))


def _make(scales=True, whole=True, bits=8):
    def make():
        ps = _params()
        return ps, Gefen(ps, lr=LR, weight_decay=WD,
                         layout=GefenLayout(factor_second_moment=True, row_group_scales=scales, whole_matrix_factor=whole),
                         bits=bits)
    return make


@pytest.mark.parametrize("scales", [True, 100])
def test_state_dict_round_trip_resumes_bit_for_bit(tmp_path, scales):
    """A state dict saved after 3 steps holds each grouped matrix's scale length and restores it
    (groups of up to 2,048 elements, or of an int's); 3 more steps equal the uninterrupted run bit
    for bit; so do a deepcopy and a pickle."""
    steps = _grads(6)
    params, opt, params2, opt2, saved = checkpoint_and_continue(_make(scales), steps, tmp_path / "o.pt")
    group = saved["opt"]["param_groups"][0]
    assert group["row_group_scales"] is scales and group["whole_matrix_factor"] is True
    most = MOST if scales is True else scales
    assert saved["opt"]["state"][1][K.SCALE_BLOCK] == _scale_length((100, 20), 20, True, most) > 20
    assert_same_state(opt, opt2, params, params2)
    assert_copies_step_alike(opt, params, _grads(2, seed=7))


@pytest.mark.parametrize("bits, scales", [(8, True), (4, True), (4, 100)])
def test_the_distributed_form_round_trips_and_resumes_bit_for_bit(tmp_path, monkeypatch, bits, scales):
    """The distributed (DCP) state form, as a process group makes it: scales and w one per element,
    each the value of its scale block or its tile's offset; loaded, each matrix has its scale length
    (groups of up to 2,048 elements, or of an int's) and one factor again, and 3 more steps equal the
    uninterrupted run bit for bit."""
    from optim.gefen import distributed as D

    monkeypatch.setattr(D, "_uses_distributed_form", lambda params: True)
    steps = _grads(6)
    params, opt, params2, opt2, saved = checkpoint_and_continue(_make(scales, bits=bits), steps, tmp_path / "o.pt")
    form = saved["opt"]["state"][1]  # the (100, 20) matrix: tiles of 20 rows but for the option
    assert D.LAYOUT in form and form[K.SCALES].shape == form[K.W].shape == (100, 20)
    scale = _scale_length((100, 20), 20, True, MOST if scales is True else scales)
    assert torch.equal(form[K.W][0], form[K.W][-1])  # one factor for every row
    assert torch.equal(form[K.SCALES].reshape(-1)[::scale].repeat_interleave(scale), form[K.SCALES].reshape(-1))
    assert_same_state(opt, opt2, params, params2)
    assert opt2.state[params2[1]][K.SCALE_BLOCK] == scale


def _first_moments(opt, params):
    """Each parameter's first moment decoded with its state's scale length."""
    out = []
    for p in params:
        st = opt.state[p]
        out.append(R.dequantize(st[K.SCALES], st[K.CODES], opt.codebook, numel=p.numel(),
                                block=K.scale_length(st), bits=opt.bits))
    return out


@pytest.mark.parametrize("to_compact", [False, True])
def test_the_distributed_form_loads_into_the_other_layout(monkeypatch, to_compact):
    """A distributed-form checkpoint of one layout whose saved group is edited to the other's loads into
    that layout (load_state_dict takes the saved groups' options). Into per-row scales
    and per-tile factors: every first moment exactly as saved (a row's scale block lies in one saved
    group) and every tile's w the saved matrix's w. Into row-group scales and one factor a matrix: each
    new scale is the largest |m| of its group of the saved first moment (recomputed here), m within
    half a codebook gap of that scale of the saved one (exact where the group held one saved scale),
    and w the mean of the saved tiles' w weighted by their rows (float64 here, to 1e-6)."""
    from optim.gefen import distributed as D

    monkeypatch.setattr(D, "_uses_distributed_form", lambda params: True)
    src_params, src = _make(scales=not to_compact, whole=not to_compact)()
    for gs in _grads(3):
        set_grads(src_params, gs)
        src.step()
    params, opt = _make(scales=to_compact, whole=to_compact)()
    sd = src.state_dict()
    sd["param_groups"][0].update(row_group_scales=to_compact, whole_matrix_factor=to_compact)
    opt.load_state_dict(sd)
    half_gap = float(src.codebook.diff().max()) / 2
    exact = 0
    for p, q, m0, m1 in zip(src_params, params, _first_moments(src, src_params), _first_moments(opt, params)):
        shape, a, b = tuple(p.shape), src.state[p], opt.state[q]
        block = b[K.BLOCK]
        assert block == a[K.BLOCK] == shape[1]
        if not to_compact:
            assert torch.equal(m1, m0), shape
            assert torch.equal(b[K.W], a[K.W].repeat(len(_tiles(shape, block, False)))), shape
            continue
        scale = _scale_length(shape, block, True)
        assert K.scale_length(b) == scale
        assert torch.equal(b[K.SCALES], m0.abs().view(-1, scale).amax(dim=1)), shape
        bound = half_gap * b[K.SCALES].repeat_interleave(scale) * (1 + 1e-6)
        assert bool(((m1 - m0).abs() <= bound).all()), shape
        one = a[K.SCALES].view(-1, scale // block).unique(dim=1).shape[1] == 1
        if one:
            assert torch.equal(m1, m0), shape
        exact += bool(torch.equal(m1, m0))
        rows = torch.tensor([r1 - r0 for r0, r1 in _tiles(shape, block, False)], dtype=torch.float64)
        want = (a[K.W].double().view(-1, block) * rows.view(-1, 1)).sum(dim=0) / rows.sum()
        assert_close(b[K.W], want.float(), rtol=1e-6, name=f"w {shape}")
    assert not to_compact or exact == 1  # requantised but the (9, 1000) matrix, a scale a row either way


def test_a_state_its_group_does_not_describe_is_refused(tmp_path):
    """Loading a state with grouped scales into a group saved without the option is refused, naming
    it; so is a scale length that does not divide its tiles; and either option switched off in the
    group once the state exists is refused at the next step."""
    steps = _grads(2)
    params, opt = _make()()
    for gs in steps:
        set_grads(params, gs)
        opt.step()
    sd = opt.state_dict()
    off = copy.deepcopy(sd)
    off["param_groups"][0]["row_group_scales"] = False
    with pytest.raises(ValueError, match="row_group_scales"):
        _make()()[1].load_state_dict(off)
    bad = copy.deepcopy(sd)
    bad["state"][1][K.SCALE_BLOCK] = 20 * 3  # 60 elements: no divisor of the 2,000-element tile
    bad["state"][1][K.SCALES] = torch.zeros(2000 // 60)
    with pytest.raises(ValueError, match=K.SCALE_BLOCK):
        _make()()[1].load_state_dict(bad)
    for key in ("row_group_scales", "whole_matrix_factor"):
        params, opt = _make()()
        set_grads(params, steps[0])
        opt.step()
        opt.param_groups[0][key] = False
        set_grads(params, steps[1])
        with pytest.raises(ValueError, match="other group options"):
            opt.step()


def test_the_options_are_flags_off_in_a_pickle_from_before_them():
    p = torch.nn.Parameter(torch.randn(4, 4))
    for key in ("row_group_scales", "whole_matrix_factor"):
        with pytest.raises(ValueError, match=key):
            Gefen([p], layout=GefenLayout(factor_second_moment=True, **{key: "yes"}))
    opt = Gefen([p], layout=GefenLayout(factor_second_moment=True, row_group_scales=True, whole_matrix_factor=True))
    state = opt.__getstate__()
    for g in state["param_groups"]:
        del g["row_group_scales"], g["whole_matrix_factor"]
    state["defaults"] = {k: v for k, v in state["defaults"].items()
                         if k not in ("row_group_scales", "whole_matrix_factor")}
    old = Gefen.__new__(Gefen)
    old.__setstate__(copy.deepcopy(state))
    assert old.param_groups[0]["row_group_scales"] is False and old.defaults["whole_matrix_factor"] is False
