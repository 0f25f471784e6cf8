"""The numba step's passes (``optim/gefen/_numba_kernels.py``) against brute force.

The optimizer-level tests compare the whole step with the reference on random gradients, which
rarely land exactly on a decision boundary, at +-1, or on a 4-bit block that starts inside a
code byte. Here each pass is driven directly: the quantisers on values at, just below and just
above every boundary (nearest entry by brute-force argmin, ties to the lower index, written
here), the nibble packing at odd starts and ends (against ``reference.pack_codes``), the
bit-pattern absmax (against ``max(abs(x))``), and the serial kernel against the parallel one.
"""

import numpy as np
import pytest
import torch

from optim.gefen import _numba_kernels as C, reference as R
from optim.gefen.codebook import code_table
from optim.gefen.numba_ops import _luts


def _brute_nearest(q, cb):
    """Index of the nearest entry per value, ties to the lower index (float64 distances)."""
    d = np.abs(q.astype(np.float64)[:, None] - cb.astype(np.float64)[None, :])
    return d.argmin(axis=1)  # argmin returns the first (lowest) index among equal distances


def _codebook(levels, gen):
    inner = torch.rand(levels - 2, generator=gen) * 2 - 1
    return torch.cat([torch.tensor([-1.0, 1.0]), inner]).sort().values


def _probe_values(cb, gen, n_random=2000):
    """Random values in [-1, 1], +-1, 0, and every midpoint with its fp32 neighbours."""
    mids = ((cb[1:].double() + cb[:-1].double()) / 2).float()
    up = torch.nextafter(mids, torch.full_like(mids, 2.0))
    down = torch.nextafter(mids, torch.full_like(mids, -2.0))
    fixed = torch.tensor([-1.0, 1.0, 0.0, -0.0])
    return torch.cat([torch.rand(n_random, generator=gen) * 2 - 1, fixed, mids, up, down, cb]).numpy()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantisers_match_brute_force_at_boundaries(bits):
    gen = torch.Generator().manual_seed(3)
    cb_t = _codebook(2**bits, gen)
    cb = cb_t.numpy()
    q = _probe_values(cb_t, gen)
    q = np.concatenate([q, np.zeros((-q.size) % 8, np.float32)]).astype(np.float32)
    expected = _brute_nearest(q, cb)
    tables = code_table(cb_t)
    assert tables.ncmp <= 1 and not tables.has_repeats  # the table the numba step runs on
    luts = _luts(tables)
    m = q.copy()
    codes = np.zeros(q.size, np.uint8)
    if bits == 8:
        u = np.zeros(q.size, np.uint32)
        C._bins(m, q.size, np.float32(1.0), np.float32(tables.scale),
                np.uint32(luts.lut_code.size - 1), u)
        C._lookup8(codes, m, u, luts.lut_code, luts.lut_bound, luts.lut_values)
    else:
        C._quantize4(m, q.size, np.float32(1.0), tuple(luts.bounds), tuple(cb), codes)
    bad = np.nonzero(codes != expected)[0]
    assert bad.size == 0, f"codes differ at {bad[:5]}: q={q[bad[:5]]}, got {codes[bad[:5]]}, want {expected[bad[:5]]}"
    np.testing.assert_array_equal(m, cb[expected])  # the selected value is C[code] exactly


@pytest.mark.parametrize("start,stop", [(0, 10), (1, 10), (1, 9), (2, 7), (5, 6), (4, 5), (0, 11), (1, 11)],
                         ids=lambda x: str(x))
def test_nibble_unpack_and_pack_at_odd_ends(start, stop):
    """A block's elements start..stop-1 (never empty) of an 11-element tensor's codes."""
    gen = torch.Generator().manual_seed(5)
    n = 11
    idx = torch.randint(0, 16, (n,), generator=gen)
    packed = R.pack_codes(idx, 4).numpy()
    out = np.full(16, 99, np.uint8)
    C._unpack4(packed, start, stop, out)
    np.testing.assert_array_equal(out[:stop - start], idx[start:stop].numpy())
    new = torch.randint(0, 16, (n,), generator=gen)
    merged = idx.clone()
    merged[start:stop] = new[start:stop]
    codes = packed.copy()
    C._pack4(new[start:stop].numpy().astype(np.uint8), start, stop, codes)
    np.testing.assert_array_equal(codes, R.pack_codes(merged, 4).numpy())  # neighbours kept


def test_absmax_bits_is_max_abs():
    gen = torch.Generator().manual_seed(7)
    for n in (1, 7, 256, 1000):
        x = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 8).numpy()
        x[::5] = -x[::5]
        got = np.array([C._absmax_bits(x.view(np.int32), n)], np.int32).view(np.float32)[0]
        assert got == np.abs(x).max()
    z = np.array([-0.0, 0.0, -0.0], np.float32)
    assert np.array([C._absmax_bits(z.view(np.int32), 3)], np.int32).view(np.float32)[0] == 0.0


def test_one_thread_step_leaves_torch_at_one_thread():
    """Starting numba's OpenMP pool once reset torch's thread count to all cores (shared
    libgomp); a fresh process (the pool starts once per process) must stay at one thread."""
    import subprocess
    import sys

    code = ("import torch; torch.set_num_threads(1)\n"
            "from optim import Gefen\n"
            "p = torch.nn.Parameter(torch.randn(64, 256)); opt = Gefen([p])\n"
            "for _ in range(2):\n"
            "    p.grad = torch.randn(64, 256) * (torch.rand(64, 1) + 0.1); opt.step()\n"
            "print(torch.get_num_threads())\n")
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "1"
