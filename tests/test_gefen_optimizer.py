"""Gefen optimizer: AdamW reduction, fast paths vs the reference, codebook, state-dict round trips,
which backend updates each parameter (``backend_of``, checked against the step that runs).

Independent references: ``torch.optim.AdamW``; ``optim.gefen.reference.gefen_step`` run tensor by
tensor (every backend's step lays tensors side by side: torch, numba, Triton interpreted); a histogram built
block by block in the test; ``torch.save``/``torch.load`` round trips.
"""

import copy
import pickle

import pytest
import torch

from optim import Gefen
from optim.backends import numba_available
from optim.gefen import reference as R, state as K
from optim.gefen.codebook import histogram, optimal_codebook
from tests.utils import assert_close, assert_same_state, checkpoint_and_continue, row_scaled_grad, set_grads

LR, WD = 1e-2, 0.1
SHAPES = [(24, 48), (7, 13), (1009,), (16, 96), (300,), (1,)]


def test_reduces_to_adamw_two_groups():
    """50 steps, two groups (second: own lr, no decay), fp32: max |Δ| <= 1e-6 against AdamW.

    Not bitwise: the compiled step (numba on CPU, where it is installed) and AdamW's foreach
    kernels round each operation to fp32, with divisions and square roots in other orders.
    """
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def groups(ps):
        return [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0}]

    ours = Gefen(groups(params), lr=LR, weight_decay=WD, layout="adamw")
    ref = torch.optim.AdamW(groups(twins), lr=LR, weight_decay=WD)
    for _ in range(50):
        grads = [torch.randn(s) for s in SHAPES]
        set_grads(params, grads)
        set_grads(twins, grads)
        ours.step()
        ref.step()
    for p, q in zip(params, twins):
        assert_close(p.detach(), q.detach(), atol=1e-6, name="p vs AdamW")


def _run_reference(starts, grads_per_step, blocks, codebook, bits):
    out = []
    for k, x in enumerate(starts):
        x, v, s, c = x.reshape(-1).float(), *R.init_state(x.numel(), block=blocks[k], bits=bits)
        for t, gs in enumerate(grads_per_step, 1):
            x, v, s, c = R.gefen_step(x, gs[k], v, s, c, codebook, step=t, lr=LR, beta1=0.9,
                                      beta2=0.999, eps=1e-8, weight_decay=WD, block=blocks[k], bits=bits)
        out.append((x, v, s, c))
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("backend", ["torch", "numba", "triton"])
def test_fast_path_matches_reference_20_steps(bits, backend):
    params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in SHAPES]
    starts = [p.detach().clone() for p in params]
    opt = Gefen(params, layout="published", lr=LR, weight_decay=WD, bits=bits, backend=backend)
    steps = [[row_scaled_grad(s) for s in SHAPES] for _ in range(20)]
    for gs in steps:
        set_grads(params, gs)
        opt.step()
    blocks = [opt.state[p][K.BLOCK] for p in params]
    assert max(blocks) > 1 and min(blocks) == 1  # both layouts are exercised
    for p, (x, v, s, c) in zip(params, _run_reference(starts, steps, blocks, opt.codebook, bits)):
        st = opt.state[p]
        assert torch.equal(st[K.CODES], c), "codes differ from the reference"
        assert_close(st[K.SCALES], s, rtol=1e-6, name="scales")
        assert_close(st[K.V], v, rtol=1e-5, name="v")
        # numba may fuse multiply-adds, Triton sums v in another order: p to a few fp32 ulps
        assert_close(p.detach().reshape(-1), x, atol=1e-6, rtol=1e-6, name="p")


def test_codebook_is_optimal_for_a_brute_force_histogram():
    shapes = [(16, 96), (300,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    grads = [row_scaled_grad(s) for s in shapes]
    opt = Gefen(params, layout="published", bits=4)
    set_grads(params, grads)
    opt.step()
    normalised = []
    for p, g in zip(params, grads):
        S = R.scale_block_length(opt.state[p][K.BLOCK])
        flat = g.reshape(-1)
        for j in range(0, flat.numel(), S):
            blk = flat[j:j + S]
            normalised.append(blk / blk.abs().max())
    centers, counts = histogram(torch.cat(normalised), bins=4096)
    expected, _ = optimal_codebook(centers, counts, 16)
    assert_close(opt.codebook, expected, atol=0, name="codebook")
    assert opt.codebook[0] == -1 and opt.codebook[-1] == 1


def test_late_parameter_gets_blocks_at_its_first_gradient_and_codebook_stays():
    a, b = torch.nn.Parameter(torch.randn(16, 96)), torch.nn.Parameter(torch.randn(24, 48))
    opt = Gefen([a, b], layout="published")
    a.grad = row_scaled_grad((16, 96))
    opt.step()
    cb = opt.codebook.clone()
    assert K.BLOCK not in opt.state[b]
    b.grad = row_scaled_grad((24, 48))
    from optim.gefen.partition import choose_block

    expected_block = choose_block(b.grad)
    opt.step()
    assert opt.state[b][K.BLOCK] == expected_block and opt.state[b][K.STEP] == 1
    assert opt.state[a][K.STEP] == 2
    assert torch.equal(opt.codebook, cb)


def test_closure_and_scheduler():
    w = torch.nn.Parameter(torch.randn(8, 32))
    twin = torch.nn.Parameter(w.detach().clone())
    x = torch.randn(16, 32)
    ours = Gefen([w], lr=0.1, layout="adamw")
    ref = torch.optim.AdamW([twin], lr=0.1, weight_decay=0.0)
    s1 = torch.optim.lr_scheduler.StepLR(ours, step_size=2, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    for _ in range(5):
        def closure(p=w):
            ours.zero_grad()
            loss = (x @ p.t()).pow(2).mean()
            loss.backward()
            return loss

        loss = ours.step(closure)
        ref.zero_grad()
        expected = (x @ twin.t()).pow(2).mean()
        expected.backward()
        ref.step()
        s1.step()
        s2.step()
        assert_close(loss.detach(), expected.detach(), rtol=1e-6, name="closure loss")
    assert ours.param_groups[0]["lr"] == pytest.approx(0.025)
    assert_close(w.detach(), twin.detach(), atol=1e-6, name="p under StepLR")


def test_state_dict_round_trip_is_exact_with_4_bit_codes(tmp_path):
    """Awkward shapes, two groups; the 8-bit default's round trip is in tests/test_protocol.py."""
    bits = 4

    def make():
        torch.manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in SHAPES]
        return ps, Gefen([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], layout="published", bits=bits,
                         weight_decay=WD)

    steps = [[row_scaled_grad(s) for s in SHAPES] for _ in range(5)]
    params, opt, params2, opt2, _ = checkpoint_and_continue(make, steps, tmp_path / "opt.pt")
    assert opt2.state[params2[0]][K.CODES].dtype == torch.uint8
    assert torch.equal(opt2.codebook, opt.codebook)
    assert_same_state(opt, opt2, params, params2)


def test_bf16_params_follow_the_reference_rounded_to_bf16():
    shapes = [(16, 96), (300,)]
    params = [torch.nn.Parameter((torch.randn(s) * 0.1).bfloat16()) for s in shapes]
    xs = [p.detach().clone() for p in params]
    opt = Gefen(params, layout="published", lr=LR, weight_decay=WD)
    states = None
    for t in range(1, 6):
        gs = [row_scaled_grad(s).bfloat16() for s in shapes]
        set_grads(params, gs)
        opt.step()
        if states is None:
            states = [R.init_state(p.numel(), block=opt.state[p][K.BLOCK], bits=8) for p in params]
        for k, p in enumerate(params):
            x, *st = R.gefen_step(xs[k], gs[k], *states[k], opt.codebook, step=t, lr=LR, beta1=0.9,
                                  beta2=0.999, eps=1e-8, weight_decay=WD,
                                  block=opt.state[p][K.BLOCK], bits=8)
            xs[k], states[k] = x.bfloat16().view(p.shape), st
    for p, x in zip(params, xs):
        assert p.dtype == torch.bfloat16 and opt.state[p][K.V].dtype == torch.float32
        assert_close(p.detach().float(), x.float(), rtol=1e-2, atol=1e-4, name="bf16 p")


def test_state_bytes_per_parameter():
    """8-bit: 1 byte a code + 8 bytes per block; 4-bit: half a byte a code."""
    p = torch.nn.Parameter(torch.randn(32, 256))
    for bits, expected in [(8, 1.0), (4, 0.5)]:
        opt = Gefen([p], layout="published", bits=bits)
        p.grad = row_scaled_grad((32, 256))
        opt.step()
        st = opt.state[p]
        per_param = sum(st[k].numel() * st[k].element_size() for k in (K.V, K.SCALES, K.CODES)) / p.numel()
        assert st[K.BLOCK] >= 256 and per_param <= expected + 8 / 256


# ---------------------------------------------------------------------------------- bad input


def test_triton_backend_dispatch_matches_torch():
    """backend="triton" hands the same lists to optim.gefen.triton_ops (interpreted on CPU here)."""
    shapes = [(16, 96), (300,)]
    ps = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    tri = Gefen(ps, layout="published", lr=LR, weight_decay=WD, backend="triton")
    ref = Gefen(qs, layout="published", lr=LR, weight_decay=WD, backend="torch")
    for _ in range(2):
        gs = [row_scaled_grad(s) for s in shapes]
        set_grads(ps, gs)
        set_grads(qs, gs)
        tri.step()
        ref.step()
    for p, q in zip(ps, qs):
        assert torch.equal(tri.state[p][K.CODES], ref.state[q][K.CODES])
        assert_close(p.detach(), q.detach(), atol=1e-6, name="p triton vs torch")


# ------------------------------------------------------------------------------ backends
@pytest.fixture
def ran(monkeypatch):
    """Which step module ran: one entry ("torch", "numba", "triton") per call, in order."""
    from optim.gefen import numba_ops, torch_ops, triton_ops

    calls, depth = [], [0]
    # numba's prepared launch (``numba_ops.run``) is its step too; a step inside another
    # (gefen_step_ running its launch, or handing data to torch) counts once, as the outer one
    for name, mod, fn in (("torch", torch_ops, "gefen_step_"), ("numba", numba_ops, "gefen_step_"),
                          ("numba", numba_ops, "run"), ("triton", triton_ops, "gefen_step_")):
        def record(*args, _name=name, _step=getattr(mod, fn), **kwargs):
            if not depth[0]:
                calls.append(_name)
            depth[0] += 1
            try:
                return _step(*args, **kwargs)
            finally:
                depth[0] -= 1
        monkeypatch.setattr(mod, fn, record)
    return calls


def _step_once(opt, params):
    set_grads(params, [row_scaled_grad(p.shape) for p in params])
    opt.step()


ADAMW64 = dict(layout="adamw")


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_backend_of_is_the_step_that_runs(ran):
    """CPU tensors: "auto" is numba, quantised or not; backend="triton" (interpreted here) is
    Triton; the step that runs is the one backend_of names."""
    ps = [torch.nn.Parameter(torch.randn(16, 96)), torch.nn.Parameter(torch.randn(300))]
    opt = Gefen([{"params": ps[:1]}, {"params": ps[1:], "quantize_first_moment": False}], layout="published")
    assert [opt.backend_of(p) for p in ps] == ["numba", "numba"]
    _step_once(opt, ps)
    assert ran == ["numba", "numba"]
    tri = Gefen([p := torch.nn.Parameter(torch.randn(16, 96))], layout="published", backend="triton")
    assert tri.backend_of(p) == "triton"
    ran.clear()
    _step_once(tri, [p])
    assert ran == ["triton"]
    with pytest.raises(ValueError, match="not a parameter"):
        opt.backend_of(p)


@pytest.mark.parametrize("backend,kwargs,match", [
    pytest.param("numba", ADAMW64, "backend='numba' cannot update parameter 0 of group 1 .*float64", id="numba-float64"),
    pytest.param("triton", ADAMW64, "backend='triton' cannot update parameter 0 of group 1 .*float64", id="triton-float64-adamw"),
    pytest.param("triton", {}, "backend='triton' cannot update .*fp32, bf16 or fp16", id="triton-float64"),
])
def test_named_backend_that_cannot_update_a_parameter_is_refused_at_construction(backend, kwargs, match):
    """A backend asked for by name is refused where it cannot run, with the reason and the way out;
    a later group it cannot take is refused by add_param_group and not added."""
    if backend == "numba" and not numba_available():
        pytest.skip("numba is not installed")
    p32, p64 = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(8, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=match + ".*use backend='torch'"):
        Gefen([{"params": [p32]}, {"params": [p64], **kwargs}], layout="published", backend=backend)
    opt = Gefen([p32], layout="published", backend=backend)
    with pytest.raises(ValueError, match="cannot update parameter 0 of group 1"):
        opt.add_param_group({"params": [p64], **kwargs})
    assert len(opt.param_groups) == 1 and opt.backend_of(p32) == backend


def test_auto_falls_back_to_torch_where_a_compiled_step_cannot_run(ran):
    """"auto" gives float64 moments (AdamW in float64) to the torch step, and says so."""
    p64, p32 = torch.nn.Parameter(torch.randn(300, dtype=torch.float64)), torch.nn.Parameter(torch.randn(300))
    opt = Gefen([{"params": [p64]}, {"params": [p32], "quantize_first_moment": True,
                                     "share_second_moment": True}], **ADAMW64)
    assert opt.backend_of(p64) == "torch"
    assert opt.backend_of(p32) == ("numba" if numba_available() else "torch")
    _step_once(opt, [p64, p32])
    assert ran == ["torch", opt.backend_of(p32)]
    assert opt.state[p64][K.V].dtype == torch.float64


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_numba_codebook_it_cannot_separate_runs_on_torch(ran):
    """The data-dependent exception (numba_ops.data_refusal): a codebook with repeated entries is
    known after construction; backend_of then says "torch", and the torch step runs."""
    p = torch.nn.Parameter(torch.randn(16, 96))
    opt = Gefen([p], layout="published", backend="numba")
    assert opt.backend_of(p) == "numba"
    opt.set_codebook(torch.linspace(-1, 1, 128).repeat_interleave(2))
    assert opt.backend_of(p) == "torch"
    _step_once(opt, [p])
    assert ran == ["torch"]


def test_triton_block_longer_than_a_program_runs_on_torch(ran):
    """The other data-dependent exception: a loaded block length Triton cannot hold."""
    from optim.gefen._triton_kernels import MAX_TILE_WIDTH

    block = 2 * MAX_TILE_WIDTH
    p = torch.nn.Parameter(torch.randn(2, block) * 0.1)
    opt = Gefen([p], layout="published", backend="triton")
    assert opt.backend_of(p) == "triton"
    sd = opt.state_dict()
    sd["state"] = {0: {K.STEP: 1, K.BLOCK: block, K.V: torch.full((2,), 1e-4), K.SCALES: torch.full((2,), 0.1),
                       K.CODES: torch.full((2 * block,), 128, dtype=torch.uint8)}}
    sd[K.CODEBOOK] = torch.linspace(-1, 1, 256)
    opt.load_state_dict(sd)
    assert opt.backend_of(p) == "torch"
    _step_once(opt, [p])
    assert ran == ["torch"]


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_backend_chosen_again_for_a_moved_parameter():
    """A parameter moved (here: made float64) before its first step is resolved again; a backend
    asked for by name that cannot take it is refused, naming what it was and what it is."""
    p = torch.nn.Parameter(torch.randn(300))
    opt = Gefen([p], **ADAMW64)
    assert opt.backend_of(p) == "numba"
    p.data = p.data.double()
    assert opt.backend_of(p) == "torch"
    q = torch.nn.Parameter(torch.randn(300))
    named = Gefen([q], backend="numba", **ADAMW64)
    q.data = q.data.double()
    q.grad = torch.randn(300, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64.*it was a torch.float32 tensor on cpu when the optimizer was built"):
        named.step()


@pytest.mark.parametrize("copy_", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["deepcopy", "pickle"])
def test_copies_choose_the_same_backends(copy_):
    """Backends are not pickled (they are keyed by parameter): a copy chooses them again, and a
    pickle made before they existed loads the same way."""
    ps = [torch.nn.Parameter(torch.randn(16, 96)), torch.nn.Parameter(torch.randn(300, dtype=torch.float64))]
    opt = Gefen([{"params": ps[:1]}, {"params": ps[1:], **ADAMW64}], layout="published")
    _step_once(opt, ps)
    opt2 = copy_(opt)
    ps2 = [p for g in opt2.param_groups for p in g["params"]]
    assert [opt2.backend_of(p) for p in ps2] == [opt.backend_of(p) for p in ps]
    state = opt.__getstate__()
    state.pop("_backends", None)
    old = Gefen.__new__(Gefen)
    old.__setstate__(copy.deepcopy(state))
    assert [old.backend_of(p) for g in old.param_groups for p in g["params"]] == [opt.backend_of(p) for p in ps]
