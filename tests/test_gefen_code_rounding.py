"""Stochastic rounding of Gefen's first-moment codes (``first_moment_rounding="stochastic"``),
checked against what it promises:

* the rule (``reference.stochastic_round``, and ``codebook.stochastic_code`` through the lookup
  table, bit for bit): the dequantised first moment is m~ in expectation (Bernstein's bound over
  many seeds, on inputs drawn fresh each run), only the two entries around m~ / s are ever
  written, exact hits keep their code;
* a small steady gradient, whose EMA nearest rounding never lets off the code at 0, moves the
  stored first moment by the EMA on average;
* the torch step equals the reference over several steps, codes and scales bitwise, the seeds
  derived from the parameter's seed as documented (its own stream, not the weights');
* runs repeat under one torch seed and leave torch's random stream alone; a run resumed from a
  state dict equals the uninterrupted one bitwise; "nearest" (the default) is the published
  reference, bit for bit, and makes no seed;
* the option's checks: values, quantize_first_moment=False, compiled backends by name, capturable.
"""

import copy
import importlib
import io
import math
import secrets

import pytest
import torch

from optim import Gefen, GefenLayout
from optim._rounding import hash32_int, random_bits, round_stochastic, step_seed
from optim.backends import numba_available, triton_interpreted
from optim.gefen import reference as R, state as K, torch_ops
from optim.gefen.codebook import code_table, stochastic_code
from optim.gefen.plan import Hyper, Tile
from tests.utils import assert_close, rel_rms

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
CODE_STREAM = 0x85EBCA6B  # documented in optim/gefen/plan.py: mixed into a parameter's seed for its codes


def random_codebook(bits, gen, repeats=False):
    """Sorted, ends at -1 and +1, the inner entries uniform; with ``repeats`` some entries twice."""
    inner = torch.rand(2**bits - 2, generator=gen) * 2 - 1
    if repeats:
        inner[1::3] = inner[0::3][: inner[1::3].numel()]
    return torch.sort(torch.cat([torch.tensor([-1.0, 1.0]), inner]))[0]


def bracket(x, cb):
    """Brute force: (first index of the largest entry <= x, first index of the smallest entry > x),
    the upper clamped to the last distinct entry (x = 1)."""
    below = torch.where(cb[None, :] <= x[:, None], cb[None, :], torch.tensor(-math.inf))
    lo_val = below.max(dim=1).values
    above = torch.where(cb[None, :] > x[:, None], cb[None, :], torch.tensor(math.inf))
    hi_val = torch.where(torch.isinf(above.min(dim=1).values), lo_val, above.min(dim=1).values)
    first = lambda v: (cb[None, :] == v[:, None]).float().argmax(dim=1)  # noqa: E731
    return first(lo_val), first(hi_val)


def bernstein(p, draws, fail=1e-9):
    """Half-width of a two-sided interval that holds the frequency of an event of probability ``p``
    in ``draws`` independent draws, except with probability ``fail`` (Bernstein's inequality)."""
    log = math.log(2 / fail)
    return (2 * p * (1 - p) * log / draws).sqrt() + 2 * log / (3 * draws)


@pytest.mark.parametrize("bits,block", [(8, 8), (4, 1), (8, 1)], ids=["8bit-P8", "4bit-P1", "8bit-P1"])
def test_the_dequantised_moment_is_m_in_expectation(bits, block):
    """Many seeds of ``reference.quantize`` on one fresh m: per element, the frequency of the upper
    entry is (x - C[lo]) / (C[hi] - C[lo]) within Bernstein's bound (each element fails with
    probability under 1e-9; plus 2**-24 for the 24-bit uniform and 1e-6 for the fp32 arithmetic),
    so the mean dequantised value is m~ within that bound times the gap times the scale. The bound
    is below nearest rounding's error on most elements: the check would catch a biased rule."""
    seed = secrets.randbits(32)
    gen = torch.Generator().manual_seed(seed)
    cb = random_codebook(bits, gen)
    n, draws = 1000, 2000
    m = torch.randn(n, generator=gen) * torch.rand(n, generator=gen)
    scales = R.block_absmax(m, R.scale_block_length(block))
    s = scales.repeat_interleave(R.scale_block_length(block))[:n]
    x = m / s
    lo, hi = bracket(x, cb)
    gap = (cb[hi] - cb[lo]).double()
    p = torch.where(gap > 0, (x.double() - cb[lo].double()) / gap, torch.zeros_like(gap))
    ups, total = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for k in range(draws):
        got_s, codes = R.quantize(m, cb, block=block, bits=bits, seed=hash32_int(seed + k))
        assert torch.equal(got_s, scales)
        idx = R.unpack_codes(codes, n, bits)
        assert bool(((idx == lo) | (idx == hi)).all()), f"seed {seed}: a code that is neither neighbour"
        ups += (idx == hi) & (hi != lo)
        total += R.dequantize(got_s, codes, cb, numel=n, block=block, bits=bits).double()
    tol = bernstein(p, draws) + 2.0**-24 + 1e-6
    freq = ups / draws
    assert bool(((freq - p).abs() <= tol).all()), f"seed {seed}: {int(((freq - p).abs() > tol).sum())} elements off"
    err = (total / draws - m.double()).abs()
    assert bool((err <= tol * gap * s.double() + 1e-7 * s.double()).all()), f"seed {seed}: max error {float(err.max())}"
    nearest = R.dequantize(*R.quantize(m, cb, block=block, bits=bits), cb, numel=n, block=block, bits=bits)
    assert float(((nearest.double() - m.double()).abs() > tol * gap * s.double()).double().mean()) > 0.5


@pytest.mark.parametrize("repeats", [False, True], ids=["distinct", "repeated-entries"])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_lookup_table_rounds_as_the_reference(bits, repeats):
    """``codebook.stochastic_code`` (the torch step's) against ``reference.stochastic_round``: the same
    codes for every input and word, the codebook's entries, midpoints and ends included."""
    gen = torch.Generator().manual_seed(3)
    cb = random_codebook(bits, gen, repeats)
    mids = (cb[1:] + cb[:-1]) / 2
    x = torch.cat([torch.rand(50_000, generator=gen) * 2 - 1, cb, mids, torch.nextafter(cb, cb + 1),
                   torch.nextafter(cb, cb - 1).clamp(-1, 1), torch.tensor([-1.0, 0.0, 1.0])])
    for seed in (0, 1, 0xDEADBEEF):
        words = random_bits(seed, 7, x.numel(), "cpu")
        ref = R.stochastic_round(x, cb, words)
        assert torch.equal(stochastic_code(x, code_table(cb), words), ref)
        lo, hi = bracket(x, cb)
        assert bool(((ref == lo) | (ref == hi)).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_exact_hits_keep_their_code(bits):
    """m~ / s on an entry (the block's absmax at +-1 among them) is written as that entry, the
    nearest rule's code, under every seed."""
    gen = torch.Generator().manual_seed(4)
    for cb in (random_codebook(bits, gen), random_codebook(bits, gen, repeats=True)):
        x = cb.repeat(20)
        want = R.nearest(x, cb)
        for seed in range(50):
            assert torch.equal(R.stochastic_round(x, cb, random_bits(seed, 0, x.numel(), "cpu")), want)
            assert torch.equal(stochastic_code(x, code_table(cb), random_bits(seed, 0, x.numel(), "cpu")), want)


def test_a_small_steady_gradient_moves_the_stored_moment_in_expectation():
    """Chunks of 256 elements (P = 1), each with one element of gradient 1 (its absmax) and 255 of
    gradient 0.03, under a 4-bit codebook with 0 and a gap of 1/7 around it: m~ / s of the small
    ones stays under half the gap, so nearest rounding keeps their first moment at 0 for good;
    stochastic rounding keeps it at its EMA 0.03 (1 - beta1**t) on average. Tolerance: six
    standard deviations of the mean, from each step's rounding error (variance at most gap**2 / 4)
    summed with weights beta1**k."""
    cb = torch.sort(torch.cat([torch.arange(-7, 8) / 7, torch.tensor([0.9])]))[0]
    chunks, delta, steps = 256, 0.03, 30
    n = 256 * chunks
    g = torch.full((n,), delta)
    g[::256] = 1.0
    small = g != 1.0
    stored = {}
    for rounding in ("nearest", "stochastic"):
        p = torch.zeros(n)
        v, s, c = R.init_state(n, block=1, bits=4)
        for t in range(1, steps + 1):
            code_seeds = [step_seed(5, 0, t)] if rounding == "stochastic" else None
            torch_ops.gefen_step_([Tile(p, v, s, c)], [g], cb, Hyper(t, **dict(HP, weight_decay=0.0)), block=1, bits=4,
                                  code_seeds=code_seeds)
        stored[rounding] = R.dequantize(s, c, cb, numel=n, block=1, bits=4)[small].double()
    ema = delta * (1 - HP["beta1"]**steps)
    assert bool((stored["nearest"] == 0).all())
    sd = math.sqrt((1 / 7) ** 2 / 4 / (1 - HP["beta1"]**2) / int(small.sum()))
    assert abs(float(stored["stochastic"].mean()) - ema) < 6 * sd, (float(stored["stochastic"].mean()), ema, sd)


KERNEL_CASES = [
    pytest.param([(4097,)], 1, 8, torch.float32, id="n4097-P1-8bit"),
    pytest.param([(1000,), (7,)], 1, 4, torch.float32, id="two-tensors-P1-4bit"),
    pytest.param([(1000,)], 8, 4, torch.bfloat16, id="n1000-P8-4bit-bf16"),
    pytest.param([(2, 1030)], 515, 4, torch.float32, id="2x1030-P515odd-4bit"),
    pytest.param([(64, 96), (27 * 32,)], 32, 8, torch.float32, id="two-tensors-P32-8bit"),
]


@pytest.mark.parametrize("shapes,block,bits,dtype", KERNEL_CASES)
def test_torch_step_matches_the_reference_over_steps(shapes, block, bits, dtype):
    """From a random state, four steps of ``torch_ops.gefen_step_`` with one code seed per tensor
    (cut into pieces of a few rows, several tensors a call) against ``reference.gefen_step`` with
    each tensor's seed: scales and codes bitwise, parameters to fp32 rounding (bf16: the
    reference's result rounded to bf16, as the optimizer stores it)."""
    gen = torch.Generator().manual_seed(2)
    cb = random_codebook(bits, gen)
    ps, refs, states = [], [], []
    for shape in shapes:
        n = torch.Size(shape).numel()
        v, s, c = R.init_state(n, block=block, bits=bits)
        v, s = torch.rand(v.shape, generator=gen) * 1e-2, torch.rand(s.shape, generator=gen) * 0.2
        c = torch.randint(0, 2**bits, (n,), generator=gen)
        c = R.pack_codes(c, bits)
        p = torch.randn(shape, generator=gen).to(dtype)
        ps.append(p)
        states.append([v, s, c])
        refs.append([p.float().reshape(-1).clone(), v.clone(), s.clone(), c.clone()])
    for t in range(1, 5):
        gs = [torch.randn(p.shape, generator=gen).to(dtype) for p in ps]
        seeds = [step_seed(1234, k, t) for k in range(len(ps))]
        torch_ops.gefen_step_([Tile(p, *st) for p, st in zip(ps, states)], gs, cb, Hyper(t, **HP), block=block,
                              bits=bits, code_seeds=seeds)
        for k, (p, g, st) in enumerate(zip(ps, gs, states)):
            ref = list(R.gefen_step(refs[k][0], g, *refs[k][1:], cb, step=t, block=block, bits=bits,
                                    code_seed=seeds[k], **HP))
            ref[0] = ref[0].to(dtype).float()
            refs[k] = ref
            assert torch.equal(st[1], ref[2]), f"scales of tensor {k} after step {t}"
            differ = int((st[2] != ref[3]).sum())
            assert torch.equal(st[2], ref[3]), f"codes of tensor {k} after step {t}: {differ} differ"
            assert_close(st[0], ref[1], atol=1e-7, rtol=1e-5, name=f"v of tensor {k} after step {t}")
            if dtype == torch.float32:
                assert_close(p.reshape(-1), ref[0], atol=1e-5, name=f"p of tensor {k} after step {t}")
            else:
                assert rel_rms(p.reshape(-1).float(), ref[0]) <= 2e-2, f"p of tensor {k} after step {t}"


@pytest.mark.parametrize("module", ["numba_ops", pytest.param("triton_ops", marks=pytest.mark.skipif(
    not triton_interpreted(), reason="Triton runs on CPU tensors only under TRITON_INTERPRET=1"))])
def test_compiled_steps_hand_code_seeds_to_the_torch_step(module):
    """Called with ``code_seeds`` (their common signature), the numba and Triton steps are the torch
    step: the same parameters, v, scales and codes, bit for bit."""
    if module == "numba_ops" and not numba_available():
        pytest.skip("no numba")
    step_ = importlib.import_module(f"optim.gefen.{module}").gefen_step_
    gen = torch.Generator().manual_seed(6)
    cb = random_codebook(8, gen)
    n, block = 4096, 16
    p = torch.randn(n, generator=gen)
    state = [torch.rand(n // block, generator=gen) * 1e-2, torch.rand(n // block, generator=gen) * 0.2,
             torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)]
    twin = [p.clone(), *[t.clone() for t in state]]
    for t in range(1, 3):
        g = torch.randn(n, generator=gen)
        seeds = [step_seed(9, 0, t)]
        step_([Tile(p, *state)], [g], cb, Hyper(t, **HP), block=block, bits=8, code_seeds=seeds)
        torch_ops.gefen_step_([Tile(*twin)], [g], cb, Hyper(t, **HP), block=block, bits=8, code_seeds=seeds)
        for a, b in zip([p, *state], twin):
            assert torch.equal(a, b)


def _params(seed=0):
    """A (48, 32) weight, a tall (96, 16) weight (six factor tiles when factored) and a (48,) bias."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((48, 32), (96, 16), (48,))]


def _grads(t, params, late=None):
    """Step ``t``'s gradients, rows scaled apart; parameter ``late`` gets zeros before step 2."""
    g = torch.Generator().manual_seed(100 + t)
    out = [torch.randn(p.shape, generator=g) * (1 + torch.arange(p.shape[0]).view(-1, *[1] * (p.dim() - 1)))
           for p in params]
    if late is not None and t < 2:
        out[late] = torch.zeros_like(out[late])
    return out


def _run(opt, params, steps, start=0, late=None):
    for t in range(start, start + steps):
        for p, g in zip(params, _grads(t, params, late)):
            p.grad = g
        opt.step()


def _against_reference(opt, params, code_seed=None, check=None):
    """Four steps of ``opt`` against ``reference.gefen_step``, codes and scales bitwise, weights to
    1e-5; ``code_seed(k, st, t)``: parameter k's code seed at step t (None: nearest rounding);
    ``check(k, st, t)`` runs after each parameter's step."""
    refs = [[p.detach().clone().reshape(-1)] for p in params]
    for t in range(4):
        grads = _grads(t, params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for k, (p, g) in enumerate(zip(params, grads)):
            st = opt.state[p]
            if t == 0:
                refs[k] += list(R.init_state(p.numel(), block=st[K.BLOCK], bits=8))
            seed = {} if code_seed is None else dict(code_seed=code_seed(k, st, t))
            refs[k] = list(R.gefen_step(*refs[k][:1], g, *refs[k][1:], opt.codebook, step=t + 1,
                                        block=st[K.BLOCK], bits=8, **seed, **HP))
            assert torch.equal(st[K.SCALES], refs[k][2]) and torch.equal(st[K.CODES], refs[k][3]), (k, t)
            assert_close(p.detach().reshape(-1), refs[k][0], atol=1e-5, name=f"p{k} after step {t + 1}")
            if check is not None:
                check(k, st, t)


def test_the_optimizer_rounds_with_the_documented_seeds():
    """Gefen (torch path) against ``reference.gefen_step`` over four steps, each parameter's code
    seed at step t derived as documented: step_seed(hash32(SEED ^ CODE_STREAM), 0, t), SEED =
    step_seed(rounding seed, parameter index, 0). Codes and scales bitwise."""
    params = _params()
    opt = Gefen(params, layout=GefenLayout(first_moment_rounding="stochastic"),
                **{k: HP[k] for k in ("lr", "weight_decay")},
                betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"])
    assert all(opt.backend_of(p) == "torch" for p in params)

    def seed_made_as_documented(k, st, t):
        if t == 0:
            assert st[K.SEED] == step_seed(opt.state_dict()[K.ROUNDING_SEED], k, 0)

    _against_reference(opt, params, lambda k, st, t: step_seed(hash32_int(st[K.SEED] ^ CODE_STREAM), 0, t + 1),
                       seed_made_as_documented)


def _trained(rounding, seed, steps=4, **kw):
    torch.manual_seed(seed)
    params = _params()
    opt = Gefen(params, lr=1e-2, layout=GefenLayout(first_moment_rounding=rounding, **kw))
    _run(opt, params, steps)
    return params, opt


@pytest.mark.parametrize("factored", [False, True], ids=["blocks", "factored"])
def test_runs_repeat_under_one_seed_and_differ_under_another(factored):
    a, oa = _trained("stochastic", 3, factor_second_moment=factored)
    b, ob = _trained("stochastic", 3, factor_second_moment=factored)
    c, oc = _trained("stochastic", 4, factor_second_moment=factored)
    for p, q in zip(a, b):
        assert torch.equal(p, q) and torch.equal(oa.state[p][K.CODES], ob.state[q][K.CODES])
    assert any(not torch.equal(oa.state[p][K.CODES], oc.state[q][K.CODES]) for p, q in zip(a, c))


def test_rounding_leaves_the_global_random_stream_alone():
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    params = _params()
    _run(Gefen(params, layout=GefenLayout(first_moment_rounding="stochastic")), params, 3)
    assert torch.equal(torch.rand(4), want)


def test_codes_and_weights_draw_from_different_streams():
    """bf16 weights with stochastic rounding and stochastic codes, one step against the reference:
    the codes are rounded with the words of step_seed(hash32(SEED ^ CODE_STREAM), 0, 1), the weights
    with those of step_seed(SEED, 0, 1) (``optim._rounding``), two different streams. The weights
    agree except where the fp32 updates differ by a rounding that crosses the random threshold
    (as between backends: at most 4 of 4096, by one bf16 unit)."""
    n = 4096
    p = torch.nn.Parameter(torch.randn(n).bfloat16())
    p0 = p.detach().float().clone()
    opt = Gefen([p], stochastic_rounding=True, layout=GefenLayout(first_moment_rounding="stochastic"), lr=HP["lr"],
                weight_decay=HP["weight_decay"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"])
    g = torch.randn(n).bfloat16()
    p.grad = g
    opt.step()
    st = opt.state[p]
    weights, codes = step_seed(st[K.SEED], 0, 1), step_seed(hash32_int(st[K.SEED] ^ CODE_STREAM), 0, 1)
    assert not torch.equal(random_bits(weights, 0, n, "cpu"), random_bits(codes, 0, n, "cpu"))
    ref = R.gefen_step(p0, g, *R.init_state(n, block=st[K.BLOCK], bits=8), opt.codebook, step=1, block=st[K.BLOCK],
                       bits=8, code_seed=codes, **HP)
    assert torch.equal(st[K.SCALES], ref[2]) and torch.equal(st[K.CODES], ref[3])
    want = round_stochastic(ref[0], torch.bfloat16, weights)
    differ = p.detach() != want
    assert int(differ.sum()) <= 4
    assert bool(((p.detach().float() - want.float()).abs() <= want.float().abs() * 2.0**-7 * 1.01)[differ].all())


@pytest.mark.parametrize("factored", [False, True], ids=["blocks", "factored"])
def test_a_resumed_run_equals_the_uninterrupted_one(factored):
    """Checkpoint after two steps (the bias still without state: its seed comes later), load into
    an optimizer made under another torch seed: the next three steps are the uninterrupted run's,
    parameters and state bit for bit."""
    kw = dict(lr=1e-2, layout=GefenLayout(first_moment_rounding="stochastic", factor_second_moment=factored))
    torch.manual_seed(11)
    whole = _params()
    ow = Gefen(whole, **kw)
    _run(ow, whole, 5, late=2)
    torch.manual_seed(11)
    first = _params()
    opt = Gefen(first, **kw)
    _run(opt, first, 2, late=2)
    assert K.SEED not in opt.state[first[2]]
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in first]}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    torch.manual_seed(999)  # another process
    resumed = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    opt2 = Gefen(resumed, **kw)
    opt2.load_state_dict(saved["opt"])
    _run(opt2, resumed, 3, start=2, late=2)
    for p, q in zip(resumed, whole):
        assert torch.equal(p, q)
        for key in (K.SCALES, K.CODES, K.V, K.SEED):
            a, b = opt2.state[p][key], ow.state[q][key]
            assert torch.equal(a, b) if torch.is_tensor(a) else a == b, key


def test_nearest_is_the_published_rule_bit_for_bit():
    """The default is "nearest": the same run as the reference without a code seed, codes and
    scales bitwise, no seed made, and the numba path still chosen where numba is installed."""
    params = _params()
    opt = Gefen(params, backend="torch", layout="published", **{k: HP[k] for k in ("lr", "weight_decay")},
                betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"])
    assert opt.param_groups[0]["first_moment_rounding"] == "nearest"

    def no_seed(k, st, t):
        assert K.SEED not in st

    _against_reference(opt, params, check=no_seed)
    assert opt.state_dict()[K.ROUNDING_SEED] is None
    explicit, oe = _trained("nearest", 0)
    default_params = _params()
    torch.manual_seed(0)
    od = Gefen(default_params, layout="published", lr=1e-2)
    _run(od, default_params, 4)
    for p, q in zip(explicit, default_params):
        assert torch.equal(p, q) and torch.equal(oe.state[p][K.CODES], od.state[q][K.CODES])
    if numba_available():
        assert all(od.backend_of(p) == "numba" for p in default_params)


def test_the_option_is_checked():
    params = _params()
    with pytest.raises(ValueError, match=r"first_moment_rounding must be one of \('nearest', 'stochastic'\)"):
        Gefen(params, layout=GefenLayout(first_moment_rounding="random"))
    with pytest.raises(ValueError, match="first_moment_rounding must be"):
        Gefen(params, layout=GefenLayout(first_moment_rounding=True))
    with pytest.raises(ValueError, match="quantize_first_moment=False: only codes are rounded"):
        Gefen(params, layout=GefenLayout(first_moment_rounding="stochastic", quantize_first_moment=False))
    opt = Gefen(params[:1], layout=GefenLayout(first_moment_rounding="stochastic"))
    with pytest.raises(ValueError, match="group 1 has first_moment_rounding='stochastic' and quantize_first_moment"):
        opt.add_param_group({"params": params[1:], "quantize_first_moment": False})
    opt.add_param_group({"params": params[1:], "quantize_first_moment": False, "first_moment_rounding": "nearest"})


@pytest.mark.skipif(not numba_available(), reason="no numba")
def test_compiled_backends_hand_it_to_the_torch_step():
    """"auto" runs a stochastic group on torch (and a nearest group beside it on numba); numba
    asked for by name is refused with the reason; capturable (the Triton step only) is refused."""
    params = _params()
    opt = Gefen([{"params": params[:2], "first_moment_rounding": "stochastic"}, {"params": params[2:]}],
                layout="published")
    assert [opt.backend_of(p) for p in params] == ["torch", "torch", "numba"]
    with pytest.raises(ValueError, match="backend='numba' cannot update .*rounds the first moment's codes "
                                         "stochastically.*use backend='torch'"):
        Gefen(params, backend="numba", layout=GefenLayout(first_moment_rounding="stochastic"))
    with pytest.raises(ValueError, match="capturable=True .*would run on torch"):
        Gefen(params, capturable=True, layout=GefenLayout(first_moment_rounding="stochastic"))


def test_load_state_dict_keeps_this_optimizers_setting():
    """As ``stochastic_rounding``: how this run rounds its codes, whatever the checkpoint's did (a
    checkpoint saved before the option existed loads as "nearest" into a nearest optimizer)."""
    params, plain = _trained("nearest", 0, steps=2)
    sd = plain.state_dict()
    old = copy.deepcopy(sd)
    for g in old["param_groups"]:
        del g["first_moment_rounding"]
    for saved in (sd, old):
        qs = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = Gefen(qs, lr=1e-2, layout=GefenLayout(first_moment_rounding="stochastic"))
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["first_moment_rounding"] == "stochastic"
        _run(opt, qs, 2, start=2)
        assert all(K.SEED in opt.state[q] for q in qs)
    off = Gefen([torch.nn.Parameter(p.detach().clone()) for p in params], layout="published", lr=1e-2)
    off.load_state_dict(opt.state_dict())
    assert off.param_groups[0]["first_moment_rounding"] == "nearest"
    again = Gefen([torch.nn.Parameter(p.detach().clone()) for p in params], layout="published", lr=1e-2)
    again.load_state_dict(old)
    assert again.param_groups[0]["first_moment_rounding"] == "nearest"
