"""Gefen's in-place steps against the torch reference; Triton runs in its interpreter on CPU.

* Every backend's step (``torch_ops``, ``numba_ops``, ``triton_ops``) against ``reference.gefen_step`` over several steps from
  a random (not fresh) state: sizes 1, 7, 1000, 4097 and 2x1030; block lengths 1 (per-element v,
  scales over 256-chunks with a partial last one), 8, 515 (odd: a packed byte straddles two
  blocks), 1030 and 1024; 8 and 4 bits; fp32 parameters held to max |Δ| <= 1e-5, bf16 to relative
  RMS <= 2e-2 (the kernel rounds to bf16 every step, as the optimizer does with the reference's
  fp32 result; measured: identical).
* Codes and scales after one step, directly: where a code differs it must still be a nearest
  entry of m~/s (brute-force argmin over all entries, written here), for a random codebook, one
  with repeated entries (what a codebook padded from a histogram with few occupied bins looks
  like; the kernel writes the same copy the reference does) and one denser than the kernel's
  lookup-table bins.
* The unquantised, per-element mode is AdamW: checked against ``torch.optim.AdamW``; unquantised
  with shared blocks against the reference (m exactly).
* A group of tensors (mixed sizes and dtypes) in one call equals each tensor stepped alone; the
  cached launch follows gradients re-allocated every step (and a gradient dtype change);
  misaligned views and ragged sizes (their own, unvectorised launches on a GPU) are still exact.
* ``optim.Gefen(backend="triton")`` (which dispatches to these kernels) against its torch backend.
* ``tiling.histogram`` (the codebook's histogram on every backend) against ``torch.histc`` of
  the block-normalised gradient.
* Bad inputs raise errors that name the argument.
"""

import pytest
import torch

from optim.gefen import numba_ops, tiling, torch_ops, triton_ops as K
from optim.gefen import reference as R
from optim.gefen.plan import Hyper, Tile
from tests.utils import assert_close, rel_rms

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
STEPS = [pytest.param(torch_ops.gefen_step_, id="torch"), pytest.param(numba_ops.gefen_step_, id="numba"),
         pytest.param(K.gefen_step_, id="triton")]


def random_codebook(bits, kind="random"):
    k = 2**bits
    if kind == "random":
        inner = torch.rand(k - 2) * 2 - 1
    elif kind == "dup":  # fewer occupied histogram bins than levels: entries repeat
        inner = torch.tensor([-0.5, 0.25, 0.25, 0.6]).repeat_interleave((k - 2) // 4 + 1)[: k - 2]
    elif kind == "dense":  # neighbours closer than one lookup-table bin (2/4096)
        inner = torch.cat([torch.arange(k // 2 - 1) * 1e-4, torch.rand(k - 2 - (k // 2 - 1)) * 2 - 1])
    return torch.sort(torch.cat([torch.tensor([-1.0, 1.0]), inner]))[0]


def random_state(n, block, bits, quantized=True):
    """A state as after some steps: random codes, positive scales, positive v."""
    v, s, c = R.init_state(n, block=block, bits=bits, quantized=quantized)
    v = torch.rand_like(v) * 1e-2
    if not quantized:
        return v, s, torch.randn(n) * 0.1
    s = torch.rand_like(s) * 0.2
    c = torch.randint(0, 256, c.shape, dtype=torch.uint8)  # at 4 bits: two random nibbles
    if bits == 4 and n % 2:
        c[-1] &= 15  # the last high nibble is padding 0
    return v, s, c


STEP_CASES = [
    pytest.param((1,), 1, 8, torch.float32, id="n1-P1-8bit"),
    pytest.param((7,), 1, 4, torch.float32, id="n7-P1-4bit"),
    pytest.param((1000,), 8, 8, torch.float32, id="n1000-P8-8bit"),
    pytest.param((1000,), 8, 4, torch.bfloat16, id="n1000-P8-4bit-bf16"),
    pytest.param((4097,), 1, 8, torch.bfloat16, id="n4097-P1-8bit-bf16"),
    pytest.param((4097,), 1, 4, torch.float32, id="n4097-P1-4bit"),
    pytest.param((2, 1030), 1030, 8, torch.float32, id="2x1030-P1030-8bit"),
    pytest.param((2, 1030), 515, 4, torch.float32, id="2x1030-P515odd-4bit"),
    pytest.param((27,), 9, 4, torch.float32, id="n27-P9odd-4bit-odd-blocks"),
    pytest.param((4, 1024), 1024, 4, torch.bfloat16, id="4x1024-P1024-4bit-bf16"),
    pytest.param((4, 1024), 1024, 8, torch.float32, id="4x1024-P1024-8bit"),
]


@pytest.mark.parametrize("step_", STEPS)
@pytest.mark.parametrize("shape,block,bits,dtype", STEP_CASES)
def test_step_matches_reference_over_steps(shape, block, bits, dtype, step_):
    n = torch.Size(shape).numel()
    cb = random_codebook(bits)
    v, s, c = random_state(n, block, bits)
    p = torch.randn(shape).to(dtype)
    ref = [p.float().reshape(-1), v.clone(), s.clone(), c.clone()]
    kp, kv, ks, kc = p.clone(), v.clone(), s.clone(), c.clone()
    for t in range(1, 4):
        g = torch.randn(shape).to(dtype)
        ref = list(R.gefen_step(*ref[:1], g, *ref[1:], cb, step=t, block=block, bits=bits, **HP))
        ref[0] = ref[0].to(dtype).float()  # the optimizer stores the reference's p in p's dtype
        step_([Tile(kp, kv, ks, kc)], [g], cb, Hyper(t, **HP), block=block, bits=bits)
        if dtype == torch.float32:
            assert_close(kp.reshape(-1), ref[0], atol=1e-5, name=f"p after step {t}")
        else:
            assert rel_rms(kp.reshape(-1), ref[0]) <= 2e-2, f"p after step {t}"
        assert_close(kv, ref[1], atol=1e-7, rtol=1e-5, name=f"v after step {t}")
        # scales and codes depend only on g and the stored first moment: exactly the reference's
        assert torch.equal(ks, ref[2]), f"scales after step {t}"
        assert torch.equal(kc, ref[3]), f"codes after step {t}: {(kc != ref[3]).sum()} differ"
    assert kp.dtype == dtype and kp.shape == torch.Size(shape)


def nearest_brute(x, cb):
    return (x[:, None] - cb[None, :]).abs().argmin(dim=1)


@pytest.mark.parametrize("kind", ["random", "dup", "dense"])
@pytest.mark.parametrize("n,block,bits", [(4097, 1, 8), (1030, 515, 4), (1000, 8, 4)],
                         ids=["4097-P1-8bit", "1030-P515-4bit", "1000-P8-4bit"])
def test_codes_and_scales_after_one_step(n, block, bits, kind):
    cb = random_codebook(bits, kind)
    v, s, c = random_state(n, block, bits)
    s0, c0 = s.clone(), c.clone()
    g = torch.randn(n) * 0.3
    p = torch.randn(n)
    _, rv, rs, rc = R.gefen_step(p, g, v.clone(), s.clone(), c.clone(), cb, step=5, block=block,
                                 bits=bits, **HP)
    K.gefen_step_([Tile(p, v, s, c)], [g], cb, Hyper(5, **HP), block=block, bits=bits)
    assert_close(s, rs, atol=0, rtol=1e-6, name="scales")
    assert_close(v, rv, atol=0, rtol=1e-6, name="v")
    # m~ / s as the reference computes it, then: is the kernel's entry a nearest one?
    m = R.dequantize(s0, c0, cb, numel=n, block=block, bits=bits)
    m = m.lerp(g, 1 - HP["beta1"])
    s_el = rs.repeat_interleave(R.scale_block_length(block))[:n]
    x = torch.where(s_el > 0, m / s_el, torch.zeros_like(m))
    kcode = R.unpack_codes(c, n, bits)
    rcode = R.unpack_codes(rc, n, bits)
    best = nearest_brute(x, cb)
    dk = (x - cb[kcode]).abs()
    db = (x - cb[best]).abs()
    assert (dk <= db + 1e-6).all(), f"kernel chose a non-nearest entry at {(dk > db + 1e-6).nonzero()[:5].tolist()}"
    differ = kcode != rcode
    if differ.any():  # allowed only at a (near) tie between two equally near entries
        assert ((x - cb[rcode]).abs()[differ] - dk[differ]).abs().max() <= 1e-6
    assert differ.float().mean() <= 1e-3


@pytest.mark.parametrize("step_", STEPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unquantised_per_element_is_adamw(dtype, step_):
    n = 1000
    p = torch.randn(n).to(dtype)
    ref = torch.nn.Parameter(p.float().clone())
    opt = torch.optim.AdamW([ref], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"])
    v, s, m = R.init_state(n, block=1, bits=8, quantized=False)
    for t in range(1, 6):
        g = torch.randn(n).to(dtype)
        ref.grad = g.float()
        opt.step()
        with torch.no_grad():
            ref.copy_(ref.to(dtype).float())
        step_([Tile(p, v, None, m)], [g], None, Hyper(t, **HP), block=1, bits=8)
    if dtype == torch.float32:
        assert_close(p, ref.detach(), atol=1e-6, name="p vs AdamW")
        assert_close(m, opt.state[ref]["exp_avg"], atol=1e-7, rtol=1e-6, name="m vs exp_avg")
        assert_close(v, opt.state[ref]["exp_avg_sq"], atol=1e-9, rtol=1e-6, name="v vs exp_avg_sq")
    else:
        assert rel_rms(p, ref.detach()) <= 2e-2


@pytest.mark.parametrize("step_", STEPS)
@pytest.mark.parametrize("n,block,dtype", [(4097, 1, torch.float32), (1000, 8, torch.bfloat16),
                                           (1030, 515, torch.float32), (4096, 1024, torch.float32)],
                         ids=["4097-P1", "1000-P8-bf16", "1030-P515odd", "4096-P1024"])
def test_unquantised_step_matches_reference_over_steps(n, block, dtype, step_):
    """An fp32 first moment (``codebook=None``) with shared blocks: m exactly the reference's (its
    lerp is torch's), v and p to fp32 rounding."""
    v, s, m = random_state(n, block, 8, quantized=False)
    p = torch.randn(n).to(dtype)
    ref = [p.float(), v.clone(), s.clone(), m.clone()]
    for t in range(1, 4):
        g = torch.randn(n).to(dtype)
        ref = list(R.gefen_step(ref[0], g, *ref[1:], None, step=t, block=block, bits=8, **HP))
        ref[0] = ref[0].to(dtype).float()
        step_([Tile(p, v, None, m)], [g], None, Hyper(t, **HP), block=block, bits=8)
        assert torch.equal(m, ref[3]), f"m after step {t}: {(m != ref[3]).sum()} differ"
        assert_close(v, ref[1], atol=1e-7, rtol=1e-5, name=f"v after step {t}")
        if dtype == torch.float32:
            assert_close(p, ref[0], atol=1e-5, name=f"p after step {t}")
        else:
            assert rel_rms(p.float(), ref[0]) <= 2e-2, f"p after step {t}"


def test_group_launch_equals_one_tensor_at_a_time():
    cb = random_codebook(8)
    shapes = [(3, 40), (1000,), (17,), (64, 8)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    ps = [torch.randn(sh).to(dt) for sh, dt in zip(shapes, dtypes)]
    gs = [torch.randn(sh).to(dt) for sh, dt in zip(shapes, dtypes)]
    states = [random_state(p.numel(), 1, 8) for p in ps]
    alone = [(p.clone(), *(t.clone() for t in st)) for p, st in zip(ps, states)]
    K.gefen_step_([Tile(p, *st) for p, st in zip(ps, states)], gs, cb, Hyper(2, **HP), block=1, bits=8)
    for (p1, v1, s1, c1), g, p, st in zip(alone, gs, ps, states):
        K.gefen_step_([Tile(p1, v1, s1, c1)], [g], cb, Hyper(2, **HP), block=1, bits=8)
        assert torch.equal(p1, p) and torch.equal(v1, st[0]) and torch.equal(s1, st[1])
        assert torch.equal(c1, st[2])


def test_cached_launch_follows_new_gradient_tensors():
    """Steps 2-4 reuse the cached launch tables; the gradients are new tensors each step (as after
    zero_grad(set_to_none=True)), once with another dtype: each step still equals the reference."""
    cb = random_codebook(8)
    shapes = [(40, 8), (96,)]
    ps = [torch.randn(sh) for sh in shapes]
    states = [random_state(p.numel(), 8, 8) for p in ps]
    refs = [[p.reshape(-1).clone(), *(t.clone() for t in st)] for p, st in zip(ps, states)]
    keep = []
    for t, gdt in zip(range(1, 5), [torch.float32, torch.float32, torch.bfloat16, torch.float32]):
        gs = [torch.randn(sh).to(gdt) for sh in shapes]
        keep.append(gs)  # keep old gradients alive, so new ones get new addresses
        K.gefen_step_([Tile(p, *st) for p, st in zip(ps, states)], gs, cb, Hyper(t, **HP), block=8, bits=8)
        for k, g in enumerate(gs):
            refs[k] = list(R.gefen_step(refs[k][0], g, *refs[k][1:], cb, step=t, block=8, bits=8, **HP))
            assert_close(ps[k].reshape(-1), refs[k][0], atol=1e-5, name=f"p[{k}] after step {t}")
            assert torch.equal(states[k][2], refs[k][3]), f"codes[{k}] after step {t}"


def test_misaligned_and_ragged_tensors_in_one_group():
    """Views at odd offsets (not 16-byte aligned) and sizes that are not whole tile rows go to
    their own launches (scalar loads on a GPU); every tensor still equals the reference."""
    cb = random_codebook(8)
    buf = torch.randn(4000)
    ps = [buf[1:1025], torch.randn(1024), buf[1500:1500 + 768 + 256 * 3 + 40]]
    gbuf = torch.randn(4000)
    gs = [gbuf[3:1027], torch.randn(1024), gbuf[2000:2000 + ps[2].numel()]]
    states = [random_state(p.numel(), 1, 8) for p in ps]
    refs = [R.gefen_step(p, g, *(t.clone() for t in st), cb, step=3, block=1, bits=8, **HP)
            for p, g, st in zip(ps, gs, states)]
    K.gefen_step_([Tile(p, *st) for p, st in zip(ps, states)], gs, cb, Hyper(3, **HP), block=1, bits=8)
    for k, (p, st, ref) in enumerate(zip(ps, states, refs)):
        assert_close(p, ref[0], atol=1e-5, name=f"p[{k}]")
        assert_close(st[1], ref[2], rtol=1e-6, name=f"scales[{k}]")
        assert (st[2] == ref[3]).float().mean() >= 0.999, f"codes[{k}]"


def test_non_contiguous_parameter_is_written_back():
    cb = random_codebook(8)
    base = torch.randn(30, 20)
    p = base.t()  # non-contiguous view
    g = torch.randn(20, 30)
    v, s, c = random_state(600, 1, 8)
    ref = R.gefen_step(p.reshape(-1), g, v.clone(), s.clone(), c.clone(), cb, step=1, block=1,
                       bits=8, **HP)
    K.gefen_step_([Tile(p, v, s, c)], [g], cb, Hyper(1, **HP), block=1, bits=8)
    assert_close(base.t().reshape(-1), ref[0], atol=1e-6, name="p through a transposed view")


@pytest.mark.parametrize("block", [1, 8, 515], ids=lambda b: f"P{b}")
def test_histogram_matches_histc(block):
    """Counts of g / (scale-block absmax) against torch.histc; two tensors and bf16 accumulate."""
    gs = [torch.randn(n) * torch.rand(n) ** 3 for n in ((4120, 1032) if block != 515 else (2060, 515))]
    gs[0][: R.scale_block_length(block)] = 0  # an all-zero scale block normalises to 0
    counts = tiling.histogram(gs, block=block) + tiling.histogram([gs[0].bfloat16()], block=block)
    expect = torch.zeros(4096)
    S = R.scale_block_length(block)
    for x in (gs[0], gs[1], gs[0].bfloat16().float()):
        a = R.block_absmax(x, S).repeat_interleave(S)[: x.numel()]
        expect += torch.histc(torch.where(a > 0, x / a, torch.zeros_like(x)), 4096, -1, 1)
    assert torch.equal(counts.float(), expect), (counts.float() - expect).abs().sum()


def test_bad_inputs_name_the_argument(monkeypatch):
    cb = random_codebook(8)
    p, g = torch.randn(16), torch.randn(16)
    v, s, c = R.init_state(16, block=8, bits=8)
    with pytest.raises(ValueError, match="scales"):
        K.gefen_step_([Tile(p, v, s[:1], c)], [g], cb, Hyper(1, **HP), block=8, bits=8)
    with pytest.raises(ValueError, match="codes"):
        K.gefen_step_([Tile(p, v, s, c.float())], [g], cb, Hyper(1, **HP), block=8, bits=8)
    with pytest.raises(ValueError, match="bits"):
        K.gefen_step_([Tile(p, v, s, c)], [g], cb, Hyper(1, **HP), block=8, bits=3)
    with pytest.raises(ValueError, match="block"):
        K.gefen_step_([Tile(p, v, s, c)], [g], cb, Hyper(1, **HP), block=5, bits=8)
    with pytest.raises(ValueError, match="sorted"):
        K.gefen_step_([Tile(p, v, s, c)], [g], cb.flip(0), Hyper(1, **HP), block=8, bits=8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors the kernels have not seen yet
    p, g = torch.randn(24), torch.randn(24)
    with pytest.raises(RuntimeError, match="backend='torch'"):
        K.gefen_step_([Tile(p, *R.init_state(24, block=8, bits=8))], [g], cb, Hyper(1, **HP), block=8, bits=8)


@pytest.mark.parametrize("bits,dtype", [(8, torch.float32), (4, torch.bfloat16)], ids=["8bit-fp32", "4bit-bf16"])
def test_optimizer_triton_backend_matches_torch_backend(bits, dtype):
    """optim.Gefen(backend='triton') dispatches groups to these kernels; same trajectory as 'torch'."""
    from optim import Gefen

    def model():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dtype)

    ma, mb = model(), model()
    oa = Gefen(ma.parameters(), layout="published", lr=1e-2, weight_decay=0.1, bits=bits, backend="triton")
    ob = Gefen(mb.parameters(), layout="published", lr=1e-2, weight_decay=0.1, bits=bits, backend="torch")
    x = torch.randn(64, 32).to(dtype)
    for _ in range(4):
        for m, o in ((ma, oa), (mb, ob)):
            o.zero_grad()
            m(x).float().square().mean().backward()
            o.step()
    for a, b in zip(ma.parameters(), mb.parameters()):
        if dtype == torch.float32:
            assert_close(a, b, atol=1e-5, name="parameter")
        else:
            assert rel_rms(a, b) <= 2e-2


# (n, P, S): a scale block of S / P v blocks; powers of two, then P and S / P that are not (lanes masked)
ROW_GROUP_CASES = [
    pytest.param(2048, 16, 256, 8, torch.float32, id="n2048-P16-S256-8bit"),
    pytest.param(1200, 20, 400, 8, torch.bfloat16, id="n1200-P20-S400-8bit-bf16"),
    pytest.param(1200, 20, 400, 4, torch.float32, id="n1200-P20-S400-4bit"),
    pytest.param(960, 48, 960, 4, torch.float32, id="n960-P48-S960-4bit"),
    pytest.param(2048, 128, 512, 4, torch.bfloat16, id="n2048-P128-S512-4bit-bf16"),  # Gefen-4bit-compact's groups
    pytest.param(1806, 43, 258, 8, torch.float32, id="n1806-P43odd-S258-8bit"),
]


@pytest.mark.parametrize("step_", STEPS)
@pytest.mark.parametrize("factored", [False, True], ids=["unfactored", "factored"])
@pytest.mark.parametrize("n,block,scale,bits,dtype", ROW_GROUP_CASES)
def test_row_group_scales_match_reference_over_steps(n, block, scale, bits, dtype, factored, step_):
    """Row-group scales (one first-moment scale per S = k P elements, ``scale``): three steps from a
    random state, with and without the factor w, against ``reference.gefen_step(scale=S)``: scales
    and codes exactly, v and w to fp32 rounding, p as in the step test above."""
    cb = random_codebook(bits)
    v, s, c = random_state(n, block, bits)
    _, s, _ = R.init_state(n, block=block, bits=bits, scale=scale)
    s = torch.rand_like(s) * 0.2
    w = torch.rand(block) if factored else None
    p = torch.randn(n).to(dtype)
    ref = [p.float(), v.clone(), s.clone(), c.clone()] + ([w.clone()] if factored else [])
    kp, kv, ks, kc = p.clone(), v.clone(), s.clone(), c.clone()
    kw = w.clone() if factored else None
    gen = torch.Generator().manual_seed(n + block)
    for t in range(1, 4):
        g = (torch.randn(n // block, block, generator=gen) * torch.exp(torch.randn(n // block, 1, generator=gen)))
        g = g.reshape(-1).to(dtype)
        ref = list(R.gefen_step(ref[0], g, *ref[1:4], cb, step=t, block=block, bits=bits, scale=scale,
                                w=ref[4] if factored else None, **HP))
        ref[0] = ref[0].to(dtype).float()
        step_([Tile(kp, kv, ks, kc, kw)], [g], cb, Hyper(t, **HP), block=block, bits=bits, scale=scale)
        assert torch.equal(ks, ref[2]), f"scales after step {t}"
        assert torch.equal(kc, ref[3]), f"codes after step {t}: {(kc != ref[3]).sum()} differ"
        assert_close(kv, ref[1], atol=1e-7, rtol=1e-5, name=f"v after step {t}")
        if factored:
            assert_close(kw, ref[4], rtol=1e-5, name=f"w after step {t}")
        if dtype == torch.float32:
            assert_close(kp, ref[0], atol=1e-5, name=f"p after step {t}")
        else:
            assert rel_rms(kp, ref[0]) <= 2e-2, f"p after step {t}"


def test_triton_refuses_row_group_scales_it_cannot_hold():
    """At 4 bits an odd block's code bytes would span two v blocks of a scale block, and blocks of 2
    elements would spill the kernel's registers: both refused by the data refusal (the optimizer
    hands them to the torch step); a scale length that is no multiple of the block is no layout at
    all: refused, naming the scale."""
    cb = random_codebook(4)
    v, s, c = R.init_state(86, block=43, bits=4, scale=86)
    with pytest.raises(ValueError, match="scale=86.*even block"):
        K.gefen_step_([Tile(torch.zeros(86), v, s, c)], [torch.zeros(86)], cb, Hyper(1, **HP), block=43, bits=4,
                      scale=86)
    assert "even block" in K.data_refusal(block=43, bits=4, quant=True, scale=86)
    assert K.data_refusal(block=43, bits=8, quant=True, scale=86) is None
    assert "3 elements or more" in K.data_refusal(block=2, bits=8, quant=True, scale=2048)
    v, s, c = R.init_state(120, block=20, bits=8, scale=60)
    with pytest.raises(ValueError, match="no whole number of v blocks"):
        K.gefen_step_([Tile(torch.zeros(120), v, s, c)], [torch.zeros(120)], cb, Hyper(1, **HP), block=20, bits=8,
                      scale=30)


@pytest.mark.parametrize("step_", STEPS)
def test_a_call_mixing_factored_and_unfactored_tiles_is_refused(step_):
    """Every tile of a call holds a factor w or none does (``tiling.factors``): a call with one of
    each is refused with an error naming the tile without w, before anything is written."""
    cb = random_codebook(8)
    tiles = [Tile(torch.randn(64), *random_state(64, 16, 8), torch.rand(16)),
             Tile(torch.randn(64), *random_state(64, 16, 8))]
    before = [t.p.clone() for t in tiles]
    with pytest.raises(ValueError, match="tile 1 holds no factor w"):
        step_(tiles, [torch.randn(64), torch.randn(64)], cb, Hyper(1, **HP), block=16, bits=8)
    assert all(torch.equal(t.p, b) for t, b in zip(tiles, before))
