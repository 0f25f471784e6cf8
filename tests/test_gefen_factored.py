"""Gefen with a factored second moment (``factor_second_moment=True``).

Independent references: ``torch.optim.AdamW`` (with P = 1, and with P > 1 on gradients whose
squares are a rank-one product of a block term and an offset term, where Adafactor's estimate
is exact); the estimator written out element by element in the test; the reference step run
tensor by tensor against every backend; ``torch.save``/``torch.load`` round trips.
"""

import math

import pytest
import torch

from optim import Gefen, GefenLayout
from optim.gefen import reference as R, state as K
from optim.gefen.partition import choose_block
from tests.utils import assert_close, assert_same_state, checkpoint_and_continue, row_scaled_grad, set_grads

LR, WD, B1, B2 = 1e-2, 0.1, 0.9, 0.999
SHAPES = [(24, 48), (30, 7), (1009,), (16, 96), (300,), (10, 14)]



def test_estimator_written_out_element_by_element():
    """One reference step against the rule spelled out with Python loops (block 4, 3 blocks)."""
    P, nb, t = 4, 3, 3
    g, w0 = torch.randn(nb * P), torch.rand(P)
    v0 = torch.rand(nb)
    p0, m0 = torch.randn(nb * P), torch.randn(nb * P)
    p, v, _, m, w = R.gefen_step(p0, g, v0, torch.zeros(0), m0, None, step=t, lr=LR, beta1=B1,
                                 beta2=B2, eps=1e-8, weight_decay=WD, block=P, bits=8, w=w0)
    w_want = [B2 * float(w0[j]) + (1 - B2) * sum(float(g[b * P + j]) ** 2 for b in range(nb)) / nb
              for j in range(P)]
    mean_w = sum(w_want) / P
    for b in range(nb):
        vb = B2 * float(v0[b]) + (1 - B2) * sum(float(g[b * P + j]) ** 2 for j in range(P)) / P
        for j in range(P):
            i = b * P + j
            mi = B1 * float(m0[i]) + (1 - B1) * float(g[i])
            denom = (vb * w_want[j] / mean_w / (1 - B2**t)) ** 0.5 + 1e-8
            want = float(p0[i]) * (1 - LR * WD) - LR / (1 - B1**t) * mi / denom
            assert abs(float(p[i]) - want) <= 1e-6 * (1 + abs(want)), (b, j, float(p[i]), want)
    assert_close(w, torch.tensor(w_want), rtol=1e-6, name="w")
    assert_close(m, B1 * m0 + (1 - B1) * g, rtol=1e-6, atol=1e-7, name="m")


@pytest.mark.parametrize("backend", ["torch", "numba", "triton"])
def test_block_1_keeps_per_element_v_and_reduces_to_adamw(backend):
    """With the factor on and P = 1 (share_second_moment=False) r == 1 exactly, so the optimizer
    keeps one v per element and, with quantisation off, is AdamW: 25 steps, max |p - AdamW| <= 1e-6
    (not bitwise: chunked torch / numba / Triton arithmetic vs AdamW's foreach kernels, each rounded
    to fp32)."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = Gefen([{"params": params[:3]}, {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0}],
                 lr=LR, weight_decay=WD, layout=GefenLayout(share_second_moment=False, quantize_first_moment=False, factor_second_moment=True), backend=backend)
    ref = torch.optim.AdamW([{"params": twins[:3]}, {"params": twins[3:], "lr": 3e-3, "weight_decay": 0.0}],
                            lr=LR, weight_decay=WD)
    for _ in range(25):
        grads = [row_scaled_grad(s, scale_columns=True) for s in SHAPES]
        set_grads(params, grads)
        set_grads(twins, grads)
        ours.step()
        ref.step()
    for p, q in zip(params, twins):
        st = ours.state[p]
        assert st[K.BLOCK] == 1 and st[K.V].numel() == p.numel() and st[K.W].numel() == 1
        assert_close(p.detach(), q.detach(), atol=1e-6, name="p vs AdamW")


def test_rank_one_squared_gradients_make_blocks_exact():
    """g[b, j]**2 = a_b * c_j (constant magnitudes, random signs): the factored block estimate is
    AdamW's per-element v exactly (in exact arithmetic), so with P = 32 (whole rows) and
    quantisation off Gefen follows AdamW to fp32 rounding (1e-5 after 30 steps at lr 1e-2);
    the shared v without the factor does not (it is off by orders of magnitude more)."""
    rows, cols = 16, 32
    a = torch.exp(2 * torch.randn(rows, 1))
    c = torch.exp(torch.randn(1, cols))
    start = torch.randn(rows, cols)
    runs = {}
    for name in ("factored", "shared", "adamw"):
        p = torch.nn.Parameter(start.clone())
        if name == "adamw":
            opt = torch.optim.AdamW([p], lr=LR, weight_decay=WD)
        else:
            opt = Gefen([p], lr=LR, weight_decay=WD,
                        layout=GefenLayout(quantize_first_moment=False, factor_second_moment=name == "factored"),
                        backend="torch")
        gen = torch.Generator().manual_seed(5)
        for _ in range(30):
            p.grad = torch.sign(torch.randn(rows, cols, generator=gen)) * (a * c).sqrt()
            opt.step()
        if name != "adamw":
            assert opt.state[p][K.BLOCK] == cols
        runs[name] = p.detach()
    assert_close(runs["factored"], runs["adamw"], atol=1e-5, name="factored vs AdamW")
    assert float((runs["shared"] - runs["adamw"]).abs().max()) > 1e-2


def _square_tiles(shape, block):
    """Row ranges of the factor's tiles, restated: a matrix of more rows than its row length C
    (with P > 1) in tiles of C rows (C + 1 for odd C), the last one shorter; else one tile."""
    if len(shape) < 2 or block == 1:
        return [(0, shape[0])]
    c = math.prod(shape[1:])
    h = c + c % 2
    return [(0, shape[0])] if shape[0] <= h else [(r, min(r + h, shape[0])) for r in range(0, shape[0], h)]


def _reference_run(starts, steps, blocks, codebook, bits):
    """The reference step on each tile of each tensor as a tensor of its own; the tiles' state
    concatenated (4-bit codes of a tile start on a byte: tiles hold an even number of elements)."""
    out = []
    for k, x0 in enumerate(starts):
        row = x0.numel() // x0.shape[0]
        parts = []
        for r0, r1 in _square_tiles(tuple(x0.shape), blocks[k]):
            x = x0.reshape(-1)[r0 * row:r1 * row].float()
            x, v, s, c = x, *R.init_state(x.numel(), block=blocks[k], bits=bits)
            w = torch.zeros(blocks[k])
            for t, gs in enumerate(steps, 1):
                g = gs[k].reshape(-1)[r0 * row:r1 * row]
                x, v, s, c, w = R.gefen_step(x, g, v, s, c, codebook, step=t, lr=LR, beta1=B1, beta2=B2,
                                             eps=1e-8, weight_decay=WD, block=blocks[k], bits=bits, w=w,
                                             bound=R.moment_bound(B1, B2))  # layout="factored" bounds m^
            parts.append((x, v, s, c, w))
        out.append(tuple(torch.cat(z) for z in zip(*parts)))
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("backend", ["torch", "numba", "triton"])
def test_every_backend_matches_the_reference(bits, backend):
    """8 steps on fresh random gradients (odd and even block lengths, P = 1 tensors): codes equal
    the reference's exactly; scales, v, w to fp32 rounding (sums in another order); p to a few
    ulps (numba and Triton compute sqrt(v_b r_j) per element as the reference does). The (30, 7)
    tensor is factored in four tiles of rows, the reference run on each as a tensor of its own."""
    params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in SHAPES]
    starts = [p.detach().clone() for p in params]
    opt = Gefen(params, lr=LR, weight_decay=WD, bits=bits, layout="factored", backend=backend)
    steps = [[row_scaled_grad(s, scale_columns=True) for s in SHAPES] for _ in range(8)]
    for gs in steps:
        set_grads(params, gs)
        opt.step()
    blocks = [opt.state[p][K.BLOCK] for p in params]
    assert min(blocks) == 1 and any(b > 1 and b % 2 for b in blocks) and any(b > 1 and not b % 2 for b in blocks), blocks
    for p, (x, v, s, c, w) in zip(params, _reference_run(starts, steps, blocks, opt.codebook, bits)):
        st = opt.state[p]
        assert torch.equal(st[K.CODES], c), "codes differ from the reference"
        assert_close(st[K.SCALES], s, rtol=1e-6, name="scales")
        assert_close(st[K.V], v, rtol=1e-5, name="v")
        assert_close(st[K.W], w, rtol=1e-5, name="w")
        assert_close(p.detach().reshape(-1), x, atol=1e-6, rtol=1e-6, name="p")


def test_per_param_group_and_state_dict_round_trip(tmp_path):
    """One factored group, one not: only the factored one holds w (block floats a tile); a saved state
    dict loads into a fresh optimizer (map_location="cpu") and two more steps equal the
    uninterrupted run bit for bit; a w of another size or dtype, or a missing w, is refused."""
    def make():
        torch.manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in SHAPES]
        return ps, Gefen([{"params": ps[:3], "factor_second_moment": True}, {"params": ps[3:]}],
                         layout="published", weight_decay=WD, backend="numba")

    steps = [[row_scaled_grad(s, scale_columns=True) for s in SHAPES] for _ in range(5)]
    path = tmp_path / "opt.pt"
    params, opt, params2, opt2, saved = checkpoint_and_continue(make, steps, path)
    for k, p in enumerate(params):
        st = opt.state[p]
        assert (K.W in st) == (k < 3)
        if k < 3:
            tiles = len(_square_tiles(SHAPES[k], st[K.BLOCK]))
            assert st[K.W].dtype == torch.float32 and st[K.W].numel() == tiles * st[K.BLOCK]
    assert_same_state(opt, opt2, params, params2)

    big = next(i for i in range(3) if saved["opt"]["state"][i][K.BLOCK] > 1)
    for bad, match in ((saved["opt"]["state"][big][K.W][:-1], "'w' must be a 1-D torch.float32"),
                       (saved["opt"]["state"][big][K.W].double(), "'w' must be a 1-D torch.float32"),
                       (None, "holds no factor 'w'")):
        sd = torch.load(path, map_location="cpu")["opt"]
        if bad is None:
            del sd["state"][big][K.W]
        else:
            sd["state"][big][K.W] = bad
        with pytest.raises(ValueError, match=match):
            make()[1].load_state_dict(sd)


def test_kernels_refuse_a_factor_of_the_wrong_layout():
    from optim.gefen import numba_ops
    from optim.gefen.plan import Hyper, Tile

    p, g = torch.zeros(64), torch.randn(64)
    v, s, c = R.init_state(64, block=16, bits=8)
    cb = torch.linspace(-1, 1, 256)
    for w, why in ((torch.zeros(8), "16 elements"), (torch.zeros(16, dtype=torch.float64), "float32"),
                   (torch.zeros(32)[::2], "contiguous")):
        with pytest.raises(ValueError, match=why):
            numba_ops.gefen_step_([Tile(p, v, s, c, w)], [g], cb, Hyper(1, LR, B1, B2, 1e-8, 0.0), block=16, bits=8)


def _adafactor_adam(start, grads, *, lr, wd, eps=1e-8):
    """AdamW whose second moment is Adafactor's row x column estimate (Shazeer & Stern, 2018),
    written out on the matrix: R, C are EMAs of the row and column means of g**2 and
    v_ij = R_i C_j / mean(C), bias-corrected as AdamW's v (no update clipping, no relative step)."""
    p, m = start.clone().double(), torch.zeros_like(start, dtype=torch.float64)
    r, c = torch.zeros(start.shape[0], dtype=torch.float64), torch.zeros(start.shape[1], dtype=torch.float64)
    for t, g in enumerate(grads, 1):
        g = g.double()
        r = B2 * r + (1 - B2) * (g * g).mean(dim=1)
        c = B2 * c + (1 - B2) * (g * g).mean(dim=0)
        m = B1 * m + (1 - B1) * g
        v = r[:, None] * c[None, :] / c.mean()
        p = p * (1 - lr * wd) - lr / (1 - B1**t) * m / ((v / (1 - B2**t)).sqrt() + eps)
    return p


@pytest.mark.parametrize("rows, cols", [(24, 32), (48, 16)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_block_of_whole_rows_becomes_one_row_and_is_adafactor(backend, rows, cols):
    """An embedding-like table whose first gradient has rows in runs of 4 alike (Gefen's rule picks
    4-row blocks): with the factor on its block is one row, and with quantisation off 30 steps
    follow AdamW with Adafactor's second moment written out on the matrix (1e-5 at lr 1e-2); a
    matrix three times as tall as wide (q, k, v stacked) follows it written out on each square
    third. The 4-row block with one per-offset factor (the reference step, not cut) is off by
    > 1e-3: rows of different scale shared one v."""
    gen = torch.Generator().manual_seed(3)
    runs = torch.exp(3 * torch.tensor([(-1.0) ** (r // 4) for r in range(rows)]))[:, None]
    grads = [torch.randn(rows, cols, generator=gen) * runs]
    for _ in range(29):  # later rows differ inside a run of 4 and columns differ
        grads.append(torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
                     * torch.exp(torch.randn(1, cols, generator=gen)))
    start = torch.randn(rows, cols, generator=gen)
    assert choose_block(grads[0]) == 4 * cols
    p = torch.nn.Parameter(start.clone())
    opt = Gefen([p], lr=LR, weight_decay=WD, layout=GefenLayout(quantize_first_moment=False, factor_second_moment=True),
                backend=backend)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert opt.state[p][K.BLOCK] == cols and opt.state[p][K.V].numel() == rows
    tiles = [(0, rows)] if rows <= cols else [(r, r + cols) for r in range(0, rows, cols)]
    want = torch.cat([_adafactor_adam(start[a:b], [g[a:b] for g in grads], lr=LR, wd=WD) for a, b in tiles])
    assert_close(p.detach().double(), want, atol=1e-5, name="factored vs Adafactor's estimate")

    x, v, w, m = start.reshape(-1).clone(), torch.zeros(rows // 4), torch.zeros(4 * cols), torch.zeros(rows * cols)
    for t, g in enumerate(grads, 1):
        x, v, _, m, w = R.gefen_step(x, g.reshape(-1), v, torch.zeros(0), m, None, step=t, lr=LR, beta1=B1,
                                     beta2=B2, eps=1e-8, weight_decay=WD, block=4 * cols, bits=8, w=w)
    assert float((x.double() - want.reshape(-1)).abs().max()) > 1e-3


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_tiles_of_a_strided_parameter_step_as_its_contiguous_copy(backend):
    """A (48, 16) parameter that is a transposed view (not contiguous) is stepped tile by tile
    through views of its rows: after 6 steps its state equals a contiguous copy's bit for bit and
    its values to an ulp (numba steps a strided tensor a piece at a time, in another order)."""
    a = torch.nn.Parameter(torch.randn(16, 48).t())
    b = torch.nn.Parameter(a.detach().contiguous())
    assert not a.is_contiguous()
    opts = [Gefen([p], lr=LR, weight_decay=WD, layout="factored", backend=backend) for p in (a, b)]
    for _ in range(6):
        g = row_scaled_grad((48, 16), scale_columns=True)
        for p, opt in zip((a, b), opts):
            p.grad = g.clone()
            opt.step()
    assert opts[0].state[a][K.W].numel() == 3 * opts[0].state[a][K.BLOCK]
    assert_close(a.detach(), b.detach(), atol=1e-6, rtol=1e-6, name="p")
    for key in (K.V, K.W, K.SCALES, K.CODES):
        assert torch.equal(opts[0].state[a][key], opts[1].state[b][key]), key


def test_a_factor_saved_for_the_whole_tensor_loads_into_every_tile():
    """A state dict whose w holds one P-vector for a tall matrix (as saved before tiles) loads:
    every tile starts from that w, and the next step equals one from a state whose tiles all
    held it."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(48, 16))
    opt = Gefen([p], lr=LR, layout="factored", backend="torch")
    p.grad = row_scaled_grad((48, 16), scale_columns=True)
    opt.step()
    sd = opt.state_dict()
    block = sd["state"][0][K.BLOCK]
    assert sd["state"][0][K.W].numel() == 3 * block
    one = torch.rand(block) + 0.5
    sd["state"][0][K.W] = one.clone()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = Gefen([q], lr=LR, layout="factored", backend="torch")
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.state[q][K.W], one.repeat(3))


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_a_vector_keeps_v_per_element(backend):
    """A 1-D tensor whose first gradient comes in runs of 32 alike (the published rule shares v
    over 32): factored, it has one v per element, and 5 steps equal those of the same vector
    with share_second_moment=False bit for bit (the matrix beside it is factored as before)."""
    runs = torch.exp(3 * torch.tensor([(-1.0) ** (i // 32) for i in range(256)]))
    assert choose_block(torch.randn(256) * runs) > 1
    torch.manual_seed(2)
    vec, mat = torch.randn(256), torch.randn(24, 48)
    a, b = [torch.nn.Parameter(vec.clone()) for _ in range(2)]
    ma, mb = [torch.nn.Parameter(mat.clone()) for _ in range(2)]
    opt_a = Gefen([a, ma], lr=LR, weight_decay=WD, layout="factored", backend=backend)
    bounded = dict(bound_first_moment=True)  # as layout="factored"
    opt_b = Gefen([{"params": [b], "share_second_moment": False, **bounded},
                   {"params": [mb], "factor_second_moment": True, **bounded}],
                  layout="published", lr=LR, weight_decay=WD, backend=backend)
    for t in range(5):
        gv, gm = torch.randn(256) * (runs if t == 0 else 1), row_scaled_grad((24, 48), scale_columns=True)
        a.grad, b.grad, ma.grad, mb.grad = gv.clone(), gv.clone(), gm.clone(), gm.clone()
        opt_a.step()
        opt_b.step()
    assert opt_a.state[a][K.BLOCK] == 1 and opt_a.state[ma][K.BLOCK] > 1
    assert torch.equal(a.detach(), b.detach()) and torch.equal(ma.detach(), mb.detach())
