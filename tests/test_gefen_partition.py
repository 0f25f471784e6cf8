"""Gefen block rules against brute-force restatements and upstream gefen, on crafted g**2.

The brute force here loops over divisors and blocks in plain Python/numpy, as the rules are
stated in ``partition.py``'s docstring; upstream's ``find_period_by_block_variance`` is the
second, independent reference of the default rule (below the 1024 cap, where both agree).
"""

import numpy as np
import pytest
import torch

from optim.gefen.partition import MAX_BLOCK, choose_block, factored_block


def _divs(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _brute_adjacent_log(g2):
    x = np.log(np.asarray(g2, dtype=np.float64) + 1e-12)
    n = x.size
    cands = [p for p in _divs(n) if n // p >= 4]
    scores = []
    for p in cands:
        means = [x[b * p:(b + 1) * p].mean() for b in range(n // p)]
        scores.append(np.mean([abs(means[b + 1] - means[b]) for b in range(len(means) - 1)]))
    best, best_p = -1.0, 1
    for i in range(1, len(cands) - 1):
        p = cands[i]
        if p > 8 and scores[i] > scores[i - 1] and scores[i] > scores[i + 1]:
            if (scores[i], p) > (best, best_p):
                best, best_p = scores[i], p
    return best_p


def _brute_variance_drop(g2):
    x = np.log(np.asarray(g2, dtype=np.float64) + 1e-12)
    n = x.size
    cands = [p for p in _divs(n) if n // p >= 4 and p > 1]
    if len(cands) < 2:
        return 1
    w = [np.mean([x[b * p:(b + 1) * p].var(ddof=1) for b in range(n // p)]) for p in cands]
    drops = [1 - w[i] / w[i + 1] if w[i + 1] > 0 else 0.0 for i in range(len(cands) - 1)]
    i = max(range(len(drops)), key=lambda k: (drops[k], cands[k]))
    return cands[i] if drops[i] >= 0.25 else 1


def _cap(p):
    return max(d for d in _divs(p) if d <= MAX_BLOCK)


def _rows_grad(rows, cols, spread=2.0):
    """A gradient whose rows have log-normal scales: the row length is the natural block."""
    return torch.randn(rows, cols) * torch.exp(torch.randn(rows, 1) * spread)


def _alternating_rows_grad(rows, cols):
    """Rows alternately ~e^3 and ~e^-3 in scale: the row length is the one right block length
    (blocks of two rows all look alike, blocks inside a row differ from their neighbours only
    at row ends)."""
    sign = torch.tensor([(-1.0) ** r for r in range(rows)]).view(rows, 1)
    return torch.randn(rows, cols) * torch.exp(3 * sign + 0.3 * torch.randn(rows, 1))


CASES = [
    pytest.param((24, 48), id="24x48"),
    pytest.param((40, 30), id="40x30"),
    pytest.param((12, 256), id="12x256"),
    pytest.param((16, 100), id="16x100"),
    pytest.param((6, 2048), id="6x2048-capped"),
]


@pytest.mark.parametrize("shape", CASES)
def test_rules_match_brute_force_on_row_structure(shape):
    g = _rows_grad(*shape)
    g2 = (g * g).reshape(-1).double().numpy()
    assert choose_block(g, "adjacent_log") == _cap(_brute_adjacent_log(g2))
    assert choose_block(g, "variance_drop") == _cap(_brute_variance_drop(g2))
    g = _alternating_rows_grad(*shape)
    g2 = (g * g).reshape(-1).double().numpy()
    assert choose_block(g, "adjacent_log") == _cap(_brute_adjacent_log(g2))
    assert choose_block(g, "variance_drop") == _cap(_brute_variance_drop(g2))
    # crafted structure: both rules find the row length (or its capped divisor)
    assert choose_block(g, "adjacent_log") == _cap(shape[1])
    assert choose_block(g, "variance_drop") == _cap(shape[1])


@pytest.mark.parametrize("shape", [pytest.param((24, 48), id="24x48"), pytest.param((8, 500), id="8x500"),
                                   pytest.param((3000,), id="iid-3000")])
def test_default_rule_matches_upstream(shape):
    import gefen.partitioning as partitioning
    g = _rows_grad(shape[0], shape[1]) if len(shape) == 2 else torch.randn(shape)
    g2 = (g.float() * g.float()).reshape(-1).double().numpy()
    upstream = partitioning.find_period_by_block_variance(g2, print_results=False)
    if upstream <= MAX_BLOCK:
        assert choose_block(g) == upstream
    else:  # upstream keeps its smallest divisor above 1024; we cap at 1024
        assert choose_block(g) == _cap(_brute_adjacent_log(g2))


@pytest.mark.parametrize("n", [1, 2, 7, 13, 31, 1009, 4099])
def test_tiny_and_prime_sizes_get_block_one(n):
    g = torch.randn(n)
    for rule in ("adjacent_log", "variance_drop"):
        assert choose_block(g, rule) == 1


def test_cap_is_a_divisor_at_most_1024():
    g = _alternating_rows_grad(8, 3 * 1024)  # rows of 3072: capped to its divisor 1024
    assert _brute_adjacent_log((g * g).reshape(-1).double().numpy()) == 3072
    assert choose_block(g) == 1024


def test_unknown_rule_is_a_clear_error():
    with pytest.raises(ValueError, match="block rule"):
        choose_block(torch.randn(64), "by_name")


@pytest.mark.parametrize("shape", [(24, 48), (30, 7), (8, 3, 5, 5), (1000,), (0, 16), (16, 0), (64, 224),
                                   (1024, 784), (12, 1000)])
def test_factored_block_is_the_longest_block_inside_one_row(shape):
    """Brute force: the largest d <= P that splits the tensor into equal blocks none of which crosses
    a row of the matrix view (shape[0], numel / shape[0]), checked block by block; 1-D tensors and
    empty shards keep P. Includes P that neither divides a row nor is a multiple of one (784 and
    1000 long rows): the block stays long instead of falling to gcd(P, row)."""
    n = int(np.prod(shape))
    for p in ([d for d in _divs(n) if d <= MAX_BLOCK] if n else [1, 16]):
        got = factored_block(p, shape)
        if len(shape) < 2 or n == 0:
            assert got == p
            continue
        row = n // shape[0]
        fits = [d for d in range(1, p + 1) if n % d == 0
                and all((b * d) // row == (b * d + d - 1) // row for b in range(0, n // d, max(1, n // d // 4096)))]
        assert got == max(fits), (shape, p, got)
        assert n % got == 0 and row % got == 0


def _numpy_adjacent_log(g):
    """The default rule restated with whole-tensor numpy reductions (float64 logs of fp32 g**2)."""
    x = np.log((np.asarray(g, dtype=np.float32) ** 2).astype(np.float64) + 1e-12)
    n = x.size
    cands = [p for p in _divs_fast(n) if n // p >= 4]
    scores = [np.abs(np.diff(x.reshape(-1, p).mean(axis=1))).mean() for p in cands]
    best = max(((s, p) for i, (p, s) in enumerate(zip(cands, scores))
                if 0 < i < len(cands) - 1 and p > 8 and s > scores[i - 1] and s > scores[i + 1]), default=None)
    return 1 if best is None else best[1]


def _divs_fast(n):
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@pytest.mark.parametrize("rows,row_len", [
    pytest.param(128, 3 * 2**10, id="3x2^17, rows of 3072"),  # candidates 3*2^k do not divide the chunk
    pytest.param(6, 65537, id="6 rows of a prime 65537", marks=pytest.mark.slow),  # blocks longer than a chunk
    pytest.param(2**9, 2**10, id="2^19, rows of 1024"),
])
def test_default_rule_on_tensors_larger_than_a_scoring_chunk(rows, row_len):
    """The chunked scoring agrees with whole-tensor reductions where chunks, blocks and candidates
    fall across each other."""
    g = torch.randn(rows, row_len) * torch.exp(2 * torch.randn(rows, 1))
    assert choose_block(g) == cap(_numpy_adjacent_log(g.numpy().reshape(-1)))


def cap(p):
    return max(d for d in _divs_fast(p) if d <= MAX_BLOCK)


# ---------------------------------------------------------------- gradients of one magnitude
def _state_bytes(st):
    return sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t))


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("bits,factored", [(8, False), (4, False), (8, True)])
def test_a_first_gradient_of_one_magnitude_does_not_fix_block_one(backend, bits, factored):
    """g = +-c everywhere says nothing about blocks: the state is the cheapest (about 1 B/param at 8
    bits, not the 5 of per-element v), and the first gradient that varies chooses the block the rule
    picks from it, with v carried over exactly (one value everywhere until then)."""
    from optim import Gefen, GefenLayout

    w = torch.nn.Parameter(torch.randn(64, 96))
    opt = Gefen([w], bits=bits, layout=GefenLayout(factor_second_moment=factored), backend=backend, betas=(0.9, 0.99))
    w.grad = 0.5 * (torch.randint(0, 2, (64, 96)) * 2 - 1).float()
    opt.step()
    st = opt.state[w]
    assert st["provisional"] is True
    assert _state_bytes(st) / w.numel() < bits / 8 + 0.2
    v0 = float(st["v"][0])
    assert v0 == pytest.approx(0.01 * 0.25, rel=1e-6)  # (1 - beta2) g**2
    g = torch.randn(64, 96) * torch.exp(2 * torch.randn(64, 1))
    w.grad = g.clone()
    opt.step()
    st = opt.state[w]
    want = choose_block(g)
    if factored:
        want = factored_block(want, g.shape)
    assert "provisional" not in st and st["block"] == want
    expected_v = 0.99 * v0 + 0.01 * (g.reshape(-1, want) ** 2).mean(dim=1)
    torch.testing.assert_close(st["v"], expected_v, rtol=1e-5, atol=0)


def test_gradients_of_one_magnitude_forever_train_as_adamw():
    """A tensor whose gradients never vary in magnitude keeps its provisional block and is updated
    as AdamW updates it (shared v is exact for it; unquantised m so the comparison is to rounding)."""
    from optim import Gefen, GefenLayout

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 48))
    ref = torch.nn.Parameter(w.detach().clone())
    opt = Gefen([w], lr=1e-2, weight_decay=0.1, layout=GefenLayout(quantize_first_moment=False), backend="torch")
    adamw = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    for step in range(10):
        g = 0.3 * (step + 1) * (torch.randint(0, 2, (32, 48)) * 2 - 1).float()
        w.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
    assert opt.state[w]["provisional"] is True and opt.state[w]["block"] > 1
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-6, atol=1e-6)


def test_a_provisional_state_resumes_and_is_checked(tmp_path):
    from optim import Gefen

    torch.manual_seed(0)
    grads = [0.5 * (torch.randint(0, 2, (64, 96)) * 2 - 1).float() for _ in range(2)]
    grads += [torch.randn(64, 96) * torch.exp(torch.randn(64, 1)) for _ in range(2)]
    w = torch.nn.Parameter(torch.randn(64, 96))
    w2 = torch.nn.Parameter(w.detach().clone())
    opt = Gefen([w], layout="published", backend="torch")
    for g in grads:
        w.grad = g.clone()
        opt.step()
    opt2 = Gefen([w2], layout="published", backend="torch")
    for g in grads[:2]:
        w2.grad = g.clone()
        opt2.step()
    torch.save(opt2.state_dict(), tmp_path / "sd.pt")
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert sd["state"][0]["provisional"] is True
    opt3 = Gefen([w2], layout="published", backend="torch")
    opt3.load_state_dict(sd)
    for g in grads[2:]:
        w2.grad = g.clone()
        opt3.step()
    assert torch.equal(w.detach(), w2.detach())
    bad = dict(sd, state={0: dict(sd["state"][0], provisional="yes")})
    with pytest.raises(ValueError, match="provisional"):
        Gefen([w2], layout="published", backend="torch").load_state_dict(bad)
