"""``codebook_refresh_every``: the codebook learned again from the gradients of every N-th step after
the first, and every stored code re-encoded onto it.

Independent references: the schedule and the re-encoding restated here by brute force (argmin over
the entries, codes unpacked one by one); a Gefen that never refreshes, whose codebook the test
relearns by hand at the same steps from the same gradients (scale-block absmax restated, the
histogram's binning and the exact DP as the first step uses them) and whose codes it re-encodes
itself; the ordinary loop for ``step_in_backward``; the uninterrupted run for a state dict.
"""

import copy
import pickle

import pytest
import torch

from optim import Gefen, GefenLayout, step_in_backward
from optim.gefen import reference as R, state as K
from optim.gefen.codebook import HIST_BINS, code_map, histogram, optimal_codebook, refresh_due
from tests.utils import assert_same_state, checkpoint_and_continue, set_grads, small_params

LR, WD = 1e-2, 0.1
SHAPES = [(24, 48), (40, 10), (33,), (7, 5, 3)]


def _grads(steps, seed=0):
    """Gradients whose spread changes from step to step (a heavier tail as t grows), so that each
    relearned codebook differs from the one before."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        gs = []
        for s in SHAPES:
            g = torch.randn(s, generator=gen)
            gs.append(g.sign() * g.abs() ** (1 + 0.4 * t))
        out.append(gs)
    return out


def _make(every, bits=8, backend="torch", **kw):
    params = small_params(SHAPES)
    return params, Gefen(params, lr=LR, weight_decay=WD, bits=bits, backend=backend,
                         layout=GefenLayout(codebook_refresh_every=every, **kw))


def _nearest_brute(x, codebook):
    """Index of the nearest entry of ``codebook`` to each x, ties to the lower index."""
    return (x.reshape(-1, 1) - codebook.reshape(1, -1)).abs().argmin(dim=1)


def _relearn_by_hand(opt, params, bits):
    """The refresh restated: each gradient divided by its scale block's absmax, binned as the first
    step bins them, the exact DP; then every code moved to the nearest new entry of its old value."""
    qs = []
    for p in params:
        S = K.scale_length(opt.state[p])
        g = p.grad.reshape(-1).float()
        pad = (-g.numel()) % S
        blocks = torch.cat([g, g.new_zeros(pad)]).view(-1, S)
        s = blocks.abs().amax(dim=1, keepdim=True)
        qs.append(torch.where(s > 0, blocks / s, torch.zeros_like(blocks)).reshape(-1)[:g.numel()])
    centers, counts = histogram(torch.cat(qs), bins=HIST_BINS)
    new, _ = optimal_codebook(centers, counts, 2**bits, fix_endpoints=True)
    old = opt.codebook
    new = new.float()
    for p in params:
        st = opt.state[p]
        idx = R.unpack_codes(st[K.CODES], p.numel(), bits)
        st[K.CODES] = R.pack_codes(_nearest_brute(old[idx], new), bits)
    opt.set_codebook(new)


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("every, factored", [(2, False), (3, True), (1, True)])
def test_steps_equal_a_codebook_relearned_by_hand_at_the_same_steps(every, factored, bits, backend):
    """8 steps: weights, codes, scales and v bitwise those of an optimizer that never refreshes and
    whose codebook the test relearns itself before steps 1 + every, 1 + 2 every, ..."""
    grads = _grads(8)
    params, opt = _make(every, bits, backend, factor_second_moment=factored)
    params2, ref = _make(0, bits, backend, factor_second_moment=factored)
    books = []
    for t, gs in enumerate(grads, 1):
        set_grads(params, gs)
        set_grads(params2, gs)
        if t > 1 and (t - 1) % every == 0:
            _relearn_by_hand(ref, params2, bits)
        opt.step()
        ref.step()
        assert torch.equal(opt.codebook, ref.codebook), t
        books.append(opt.codebook.clone())
    assert_same_state(opt, ref, params, params2)
    changed = [t for t in range(2, 9) if not torch.equal(books[t - 1], books[t - 2])]
    assert changed == [t for t in range(2, 9) if (t - 1) % every == 0]


@pytest.mark.parametrize("bits", [8, 4])
def test_code_map_takes_each_byte_to_the_nearest_new_entries(bits):
    """Every byte's codes (one or two) go to the nearest entry of the new codebook to their old
    value, restated by argmin; the ends -1 and +1 map to themselves."""
    gen = torch.Generator().manual_seed(bits)
    for _ in range(5):
        old, new = (torch.cat([torch.tensor([-1.0]), torch.rand(2**bits - 2, generator=gen) * 2 - 1,
                               torch.tensor([1.0])]).sort().values for _ in range(2))
        table = code_map(old, new, bits)
        assert table.dtype == torch.uint8 and table.shape == (256,)
        for byte in range(256 if bits == 4 else 2**bits):
            codes = [byte] if bits == 8 else [byte & 15, byte >> 4]
            want = [int(_nearest_brute(old[c].reshape(1), new)) for c in codes]
            got = [int(table[byte])] if bits == 8 else [int(table[byte]) & 15, int(table[byte]) >> 4]
            assert got == want, (byte, got, want)
        assert int(table[0]) == 0 and int(table[255]) == 255  # the ends (a 4-bit byte holds two)


def test_refresh_steps_are_every_n_after_the_first():
    assert [t for t in range(1, 12) if refresh_due(t, 3)] == [4, 7, 10]
    assert [t for t in range(1, 12) if refresh_due(t, 1)] == list(range(2, 12))
    assert not any(refresh_due(t, 0) for t in range(1, 12))


def test_a_state_dict_resumes_across_a_refresh(tmp_path):
    """Saved after step 3, every 2: the resumed run refreshes at step 5 as the uninterrupted one."""
    grads = _grads(7)
    params, opt, params2, opt2, saved = checkpoint_and_continue(lambda: _make(2, 4), grads, tmp_path / "ck.pt",
                                                                split=3)
    assert_same_state(opt, opt2, params, params2)
    assert torch.equal(opt.codebook, opt2.codebook)
    assert not torch.equal(saved["opt"]["codebook"], opt.codebook)  # it changed after the checkpoint


def test_copies_keep_the_setting_and_the_schedule():
    """deepcopy and pickle keep ``codebook_refresh_every``; an optimizer loading the state dict
    saved before a refresh step refreshes there as the original does."""
    grads = _grads(6)
    params, opt = _make(2, 4)
    for gs in grads[:2]:
        set_grads(params, gs)
        opt.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone.codebook_refresh_every == 2 and clone.defaults["codebook_refresh_every"] == 2
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = Gefen(twin_params, lr=LR, weight_decay=WD, bits=4, backend="torch",
                 layout=GefenLayout(codebook_refresh_every=2))
    twin.load_state_dict(opt.state_dict())
    for gs in grads[2:]:
        set_grads(params, gs)
        set_grads(twin_params, gs)
        opt.step()
        twin.step()
    assert_same_state(opt, twin, params, twin_params)


@pytest.mark.parametrize("value", [-1, True, 1.5, "3", None])
def test_bad_values_are_refused_by_name(value):
    with pytest.raises(ValueError, match="codebook_refresh_every"):
        Gefen(small_params(SHAPES), layout=GefenLayout(codebook_refresh_every=value))


def test_refused_with_capturable_and_per_group():
    with pytest.raises(ValueError, match="codebook_refresh_every.*capturable"):
        Gefen(small_params(SHAPES), layout=GefenLayout(codebook_refresh_every=5), capturable=True)
    params = small_params(SHAPES)
    opt = Gefen(params[:2], layout=GefenLayout(codebook_refresh_every=5))
    with pytest.raises(ValueError, match="codebook_refresh_every"):
        opt.add_param_group({"params": params[2:], "codebook_refresh_every": 7})
    with pytest.raises(ValueError, match="codebook_refresh_every"):
        Gefen([{"params": params[:2]}, {"params": params[2:], "codebook_refresh_every": 3}], layout="published")


def test_a_step_without_gradients_leaves_the_codebook_to_the_next_one():
    """A due step on which no parameter has a gradient learns nothing; the next step with
    gradients refreshes, from its own gradients (as a run without the empty call)."""
    grads = _grads(4)
    params, opt = _make(2, 4)
    params2, ref = _make(2, 4)
    for t, gs in enumerate(grads, 1):
        if t == 3:
            before = opt.codebook.clone()
            for p in params:
                p.grad = None
            opt.step()
            assert torch.equal(opt.codebook, before)
        set_grads(params, gs)
        set_grads(params2, gs)
        opt.step()
        ref.step()
    assert torch.equal(opt.codebook, ref.codebook)
    assert_same_state(opt, ref, params, params2)


@pytest.mark.parametrize("every", [1, 2])
def test_step_in_backward_equals_the_ordinary_loop(every):
    """Under ``step_in_backward`` a refresh step's backward holds every gradient until it ends, as
    the first step's does, and each parameter then steps with the new codebook: bitwise the loop's."""
    def model_and_opt():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
        return model, Gefen(model.parameters(), lr=LR, weight_decay=WD, bits=4, backend="torch",
                            layout=GefenLayout(factor_second_moment=True, codebook_refresh_every=every))

    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(16, 12, generator=gen) * (1 + t), torch.randn(16, 3, generator=gen)) for t in range(6)]
    loop, opt = model_and_opt()
    for x, y in batches:
        torch.nn.functional.mse_loss(loop(x), y).backward()
        opt.step()
        opt.zero_grad()
    hooked, opt2 = model_and_opt()
    learned, learn = [], opt2.learn_from_gradients

    def recording():  # called once a backward that held its gradients ends
        learned.append(sum(p.grad is not None for p in hooked.parameters()))
        learn()

    opt2.learn_from_gradients = recording
    with step_in_backward(opt2):
        for x, y in batches:
            torch.nn.functional.mse_loss(hooked(x), y).backward()
    assert learned == [4] * (1 + sum((t - 1) % every == 0 for t in range(2, 7)))  # every gradient, held
    assert torch.equal(opt.codebook, opt2.codebook)
    for p, q in zip(loop.parameters(), hooked.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_triton_step_takes_the_refreshed_codebook(bits):
    """The Triton step (its interpreter here) after each refresh steps with the new codebook's
    tables: codebooks, scales and codes equal the torch step's at every step, weights to fp32
    rounding (the kernel sums g**2 in another order)."""
    grads = _grads(5)
    runs = {name: _make(2, bits, name, factor_second_moment=True) for name in ("triton", "torch")}
    for gs in grads:
        for params, opt in runs.values():
            set_grads(params, gs)
            opt.step()
        assert torch.equal(runs["triton"][1].codebook, runs["torch"][1].codebook)
    (pt, ot), (pr, orf) = runs["triton"], runs["torch"]
    assert [ot._path_of(p, ot.param_groups[0], ot._backends[p].backend) for p in pt] == ["triton"] * len(pt)
    for p, q in zip(pt, pr):
        a, b = ot.state[p], orf.state[q]
        assert torch.equal(a[K.SCALES], b[K.SCALES]) and torch.equal(a[K.CODES], b[K.CODES]), tuple(p.shape)
        assert torch.allclose(p, q, atol=1e-5), tuple(p.shape)


def test_non_finite_gradients_at_a_refresh_count_as_zeros():
    """A refresh step whose gradients hold NaN and inf learns from the finite ones (those elements
    as zeros): the codebook a run with zeros there learns, and training goes on."""
    grads = _grads(3)
    bad = [g.clone() for g in grads[2]]
    bad[0][0, 0], bad[1][2, 3], bad[3][0, 0, 0] = float("nan"), float("inf"), -float("inf")
    zeroed = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in bad]
    books = []
    for last in (bad, zeroed):
        params, opt = _make(2, 4)
        for gs in grads[:2] + [last]:
            set_grads(params, gs)
            opt.step()
        books.append(opt.codebook)
    assert torch.equal(books[0], books[1]) and bool(torch.isfinite(books[0]).all())
