"""The factored second moment's column factors w in bf16 (``factor_dtype="bfloat16"``): half their
bytes, updated in fp32 and stored rounded stochastically.

Independent references: the fp32 EMA written out here (which the bf16 factor follows where
round-to-nearest freezes it), bf16's two neighbours of a value found from its bit pattern, the
reference step (``reference.gefen_step``) run tile by tile with the seeds the docstrings specify,
a state dict round trip against the uninterrupted run, and state dicts and groups edited apart.
"""

import copy

import pytest
import torch

from optim import Gefen, GefenLayout
from optim._rounding import hash32_int, step_seed
from optim.gefen import reference as R, state as K
from tests.test_gefen_layout_options import SHAPES, _grads, _params, _tiles
from tests.utils import assert_close, assert_copies_step_alike, assert_same_state, checkpoint_and_continue, set_grads

LR, WD, B1, B2 = 1e-2, 0.1, 0.9, 0.999
FACTOR_STREAM = 0xC2B2AE35  # mixed into a parameter's seed for its factor's words (plan.FACTOR_STREAM)


def _factor_seed(seed: int, step: int, tile: int | None) -> int:
    """The seed of one tile's factor rounding at ``step``, as ``Gefen``'s docstrings derive it."""
    per = step_seed(hash32_int(seed ^ FACTOR_STREAM), 0, step)
    return per if tile is None else step_seed(per, tile, 0)


def _neighbours(x: torch.Tensor):
    """The bf16 values just below and just above each positive fp32 ``x``, from its bit pattern:
    truncating the low 16 bits gives the one below (or x itself), one more unit the one above."""
    bits = x.view(torch.int32)
    low = (bits & ~0xFFFF)
    below = low.view(torch.float32)
    above = (low + 0x10000).view(torch.float32)
    return below, torch.where(below == x, below, above)


def test_a_bf16_factor_follows_the_fp32_ema_where_nearest_rounding_freezes_it():
    """w = 1 at every offset, then 3,000 steps of mean squares 1.5: the fp32 EMA reaches
    1 + 0.5 (1 - 0.999**3000) = 1.475; a bf16 w rounded to nearest never moves (each step adds
    5e-4, under half a unit of 2**-8); the stochastically rounded one ends within 5% of the fp32
    value at every offset (a few bf16 units: the rounding's noise, which the EMA averages), its root
    mean square error under 2%, and its mean over 256 offsets within 0.5%."""
    block, steps = 256, 3000
    g = torch.full((4 * block,), 1.5 ** 0.5)
    w16 = torch.ones(block, dtype=torch.bfloat16)
    nearest = torch.ones(block, dtype=torch.bfloat16)
    for t in range(1, steps + 1):
        w16 = R.factor_update(w16, g, block=block, beta2=B2, seed=step_seed(12345, 0, t))
        nearest = (B2 * nearest.float() + (1 - B2) * 1.5).to(torch.bfloat16)
    want = 1 + 0.5 * (1 - B2**steps)
    assert bool((nearest == 1).all())
    assert w16.dtype == torch.bfloat16
    err = w16.float() / want - 1
    assert float(err.abs().max()) < 0.05 and float(err.square().mean().sqrt()) < 0.02
    assert abs(float(w16.float().mean()) / want - 1) < 0.005


def test_a_bf16_factor_is_rounded_to_a_neighbour_without_bias_and_keeps_offsets_that_are_not_finite():
    """One update of random w and gradients: each new w is one of the two bf16 neighbours of the
    fp32 update (written out here); over 2,000 seeds the mean of each offset's result is the fp32
    value within 5 standard errors of a two-point draw; an offset whose update is not finite keeps
    its old bf16 value bitwise."""
    gen = torch.Generator().manual_seed(4)
    block = 64
    w = (torch.rand(block, generator=gen) + 0.5).to(torch.bfloat16)
    g = torch.randn(8 * block, generator=gen) * 3
    want = B2 * w.float() + (1 - B2) * (g * g).view(-1, block).mean(dim=0)
    below, above = _neighbours(want)
    draws = torch.stack([R.factor_update(w, g, block=block, beta2=B2, seed=s).float() for s in range(2000)])
    assert bool(((draws == below) | (draws == above)).all())
    spread = ((above - want) * (want - below)).sqrt()  # the two-point draw's standard deviation
    assert bool(((draws.mean(dim=0) - want).abs() <= 5 * spread / 2000 ** 0.5 + 1e-12).all())
    g[3] = float("nan")
    out = R.factor_update(w, g, block=block, beta2=B2, seed=7)
    assert out[3].view(torch.int16) == w[3].view(torch.int16)


def _reference(start, steps, k, block, codebook, bits, seed):
    """Tensor ``k`` stepped tile by tile by the reference step with a bf16 w and the seeds of
    ``_factor_seed``: (p, v, scales, codes, w), tiles' state concatenated."""
    row, parts = start.numel() // start.shape[0], []
    tiles = _tiles(tuple(start.shape), block, False)
    for i, (r0, r1) in enumerate(tiles):
        x = start.reshape(-1)[r0 * row:r1 * row].float()
        x, v, s, c = x, *R.init_state(x.numel(), block=block, bits=bits)
        w = torch.zeros(block, dtype=torch.bfloat16)
        for t, gs in enumerate(steps, 1):
            g = gs[k].reshape(-1)[r0 * row:r1 * row]
            x, v, s, c, w = R.gefen_step(x, g, v, s, c, codebook, step=t, lr=LR, beta1=B1, beta2=B2, eps=1e-8,
                                         weight_decay=WD, block=block, bits=bits, w=w,
                                         factor_seed=_factor_seed(seed, t, i if len(tiles) > 1 else None))
        parts.append((x, v, s, c, w))
    return [torch.cat(z) for z in zip(*parts)]


@pytest.mark.parametrize("bits", [8, 4])
def test_steps_equal_the_reference_with_a_bf16_factor(bits):
    """6 steps: every matrix holds a bf16 w of one row a tile, and codes, scales, v and w equal the
    reference stepped tile by tile with the specified seeds (codes exactly; w to one bf16 unit, where
    a sum of squares added in another order may cross a rounding threshold; the rest to 1e-5)."""
    steps = _grads(6)
    params = _params()
    starts = [p.detach().clone() for p in params]
    opt = Gefen(params, lr=LR, weight_decay=WD, bits=bits,
                layout=GefenLayout(factor_second_moment=True, factor_dtype="bfloat16"))
    for gs in steps:
        set_grads(params, gs)
        opt.step()
    for k, p in enumerate(params):
        st, shape = opt.state[p], tuple(p.shape)
        block = st[K.BLOCK]
        assert block == shape[1] and st[K.W].dtype == torch.bfloat16
        assert st[K.W].numel() == len(_tiles(shape, block, False)) * block
        x, v, s, c, w = _reference(starts[k], steps, k, block, opt.codebook, bits, st[K.SEED])
        assert torch.equal(st[K.CODES], c), f"codes of {shape} differ from the reference"
        assert_close(st[K.W].float(), w.float(), rtol=2.0**-7, name=f"w {shape}")
        assert_close(st[K.SCALES], s, rtol=1e-5, name=f"scales {shape}")
        assert_close(st[K.V], v, rtol=1e-6, name=f"v {shape}")
        assert_close(p.detach().reshape(-1), x, atol=1e-5, rtol=1e-5, name=f"p {shape}")


def test_a_bf16_factor_halves_the_factor_bytes_and_nothing_else():
    """State bytes after one step of a (512, 128) matrix in 4 tiles: the fp32 factor's 4 x 4 x 128
    become 2 x 4 x 128; every other tensor is the same size."""
    p = torch.nn.Parameter(torch.zeros(512, 128))
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(512, 128, generator=gen) * torch.exp(2 * torch.randn(512, 1, generator=gen))
    per = {}
    for dtype in ("float32", "bfloat16"):
        opt = Gefen([p], layout=GefenLayout(factor_second_moment=True, factor_dtype=dtype))
        p.grad = grad.clone()
        opt.step()
        per[dtype] = {k: t.numel() * t.element_size() for k, t in opt.state[p].items() if torch.is_tensor(t)}
    assert per["float32"][K.W] == 4 * 4 * 128 and per["bfloat16"][K.W] == 2 * 4 * 128
    assert {k: b for k, b in per["float32"].items() if k != K.W} == {k: b for k, b in per["bfloat16"].items()
                                                                       if k != K.W}


def _make():
    ps = _params()
    return ps, Gefen(ps, lr=LR, weight_decay=WD, layout=GefenLayout(factor_second_moment=True, factor_dtype="bfloat16"))


def test_state_dict_round_trip_resumes_bit_for_bit(tmp_path):
    """A state dict saved after 3 steps holds each bf16 w and each parameter's seed; 3 more steps
    equal the uninterrupted run bit for bit; so do a deepcopy and a pickle."""
    params, opt, params2, opt2, saved = checkpoint_and_continue(_make, _grads(6), tmp_path / "o.pt")
    assert saved["opt"]["param_groups"][0]["factor_dtype"] == "bfloat16"
    assert all(st[K.W].dtype == torch.bfloat16 and K.SEED in st for st in saved["opt"]["state"].values())
    assert_same_state(opt, opt2, params, params2)
    assert_copies_step_alike(opt, params, _grads(2, seed=7))


def test_the_distributed_form_round_trips_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """The distributed (DCP) state form: w one per element in fp32 (each bf16 value exactly); loaded,
    each matrix has its bf16 w per tile again and 3 more steps equal the uninterrupted run bit for
    bit."""
    from optim.gefen import distributed as D

    monkeypatch.setattr(D, "_uses_distributed_form", lambda params: True)
    params, opt, params2, opt2, saved = checkpoint_and_continue(_make, _grads(6), tmp_path / "o.pt")
    form = saved["opt"]["state"][1]
    assert D.LAYOUT in form and form[K.W].shape == SHAPES[1]
    assert all(opt2.state[p][K.W].dtype == torch.bfloat16 for p in params2)
    assert_same_state(opt, opt2, params, params2)


@pytest.mark.parametrize("bits, grouped, dtype", [(8, False, torch.float32), (4, True, torch.float32),
                                                  (4, False, torch.bfloat16)])
def test_every_backend_steps_it_as_the_torch_step(bits, grouped, dtype):
    """bf16 factors on every backend, alone and with row-group scales (the compact layouts' v blocks
    in lanes of their own), on fp32 and on bf16 parameters (numba's piecewise step, the Triton
    step's bf16 loads): "auto" (numba on the CPU) and the Triton step (its interpreter here; with
    row-group scales the (30, 7) matrix, odd P at 4 bits, excepted: the torch step's) hold the
    torch step's codes and scales exactly after 3 steps, w to one bf16 unit (a column sum added in
    another order may cross a rounding threshold), v to 1e-5 and p to 1e-5 (bf16 p: one unit)."""
    steps = _grads(3)
    runs = {}
    for name in ("auto", "triton", "torch"):
        params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params()]
        opt = Gefen(params, lr=LR, weight_decay=WD, bits=bits,
                    layout=GefenLayout(factor_second_moment=True, factor_dtype="bfloat16", row_group_scales=grouped),
                    backend=name)
        for gs in steps:
            set_grads(params, gs)
            opt.step()
        runs[name] = (params, opt)
    pt, ot = runs["torch"]
    paths = {name: [o._path_of(p, o.param_groups[0], o._backends[p].backend) for p in ps]
             for name, (ps, o) in runs.items()}
    assert set(paths["auto"]) == {"numba"}
    odd = grouped and bits == 4  # row-group scales of odd P at 4 bits: the torch step's
    assert paths["triton"] == ["torch" if odd and p.shape[1] % 2 else "triton" for p in pt]
    for name in ("auto", "triton"):
        pa, oa = runs[name]
        for p, q in zip(pa, pt):
            a, b, where = oa.state[p], ot.state[q], f"{name} {tuple(p.shape)} {dtype}"
            assert a[K.W].dtype == torch.bfloat16 and a[K.SEED] == b[K.SEED]
            assert torch.equal(a[K.CODES], b[K.CODES]) and torch.equal(a[K.SCALES], b[K.SCALES]), where
            assert_close(a[K.W].float(), b[K.W].float(), rtol=2.0**-7, name=f"w {where}")
            assert_close(a[K.V], b[K.V], rtol=1e-5, name=f"v {where}")
            assert_close(p.float(), q.float(), atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 2.0**-7,
                         name=where)


def test_a_factor_of_another_dtype_than_its_group_says_is_refused():
    """factor_dtype takes "float32" or "bfloat16" only; edited in the group once the state exists it
    is refused at the next step; a state dict whose w is bf16 while its saved group says float32
    is refused, naming the option."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    for value in ("bf16", torch.bfloat16, "float16", None):
        with pytest.raises(ValueError, match="factor_dtype"):
            Gefen([p], layout=GefenLayout(factor_second_moment=True, factor_dtype=value))
    steps = _grads(2)
    params, opt = _make()
    set_grads(params, steps[0])
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["factor_dtype"] = "float32"
    set_grads(params, steps[1])
    with pytest.raises(ValueError, match="factor_dtype"):
        opt.step()
    sd["param_groups"][0]["factor_dtype"] = "float32"
    with pytest.raises(ValueError, match="factor_dtype"):
        _make()[1].load_state_dict(sd)
