"""Compiled (numba) divide-and-conquer DP for the optimal codebook; see ``codebook.py``.

Kept in its own module so that ``import optim.gefen.codebook`` does not import numba; the pure
numpy path in ``codebook.py`` computes the same optimum and is used when numba is missing.

Why numba: the level-synchronous numpy D&C makes about 15 array calls per recursion depth, about
50 k calls for 4096 bins x 256 levels, so Python call overhead dominates it; compiled, the same
O(K·B·log B) work has no per-call cost (``experiments/codebook_dp.py`` times both).
"""

import numpy as np
from numba import njit

# Cost kinds of one group of bins: its own weighted mean, or a pinned level of -1 / +1.
MEAN, PIN_LO, PIN_HI = 0, 1, 2


@njit(cache=True, nogil=True)
def _group_cost(pw, pwx, pwx2, i, j, kind):
    """Weighted squared error of bins [i, j) against their mean (MEAN) or a pinned -1/+1."""
    s0 = pw[j] - pw[i]
    s1 = pwx[j] - pwx[i]
    s2 = pwx2[j] - pwx2[i]
    if kind == MEAN:
        return s2 - s1 * s1 / s0
    c = -1.0 if kind == PIN_LO else 1.0
    return s2 - 2.0 * c * s1 + c * c * s0


@njit(cache=True, nogil=True)
def dp_splits_numba(pw, pwx, pwx2, levels, fix_endpoints):
    """Group boundaries 0 = b_0 < ... < b_K = n of the optimal partition, and its DP cost.

    ``pw, pwx, pwx2``: float64 prefix sums (length n + 1) of w, w·x, w·x². Requires
    1 <= levels <= n. Row k of the DP, D[k][j] = min_i D[k-1][i] + cost_k(i, j), is filled by
    divide and conquer over j: the argmin is non-decreasing in j because the group cost is Monge
    (quadrangle inequality), so each recursion depth scans O(n) candidates. Ties take the
    smallest i.
    """
    n = pw.shape[0] - 1
    K = levels
    inf = np.inf
    prev = np.full(n + 1, inf)
    prev[0] = 0.0
    cur = np.full(n + 1, inf)
    arg = np.zeros((K + 1, n + 1), dtype=np.int32)
    stack = np.empty((256, 4), dtype=np.int64)
    for k in range(1, K + 1):
        kind = MEAN
        if fix_endpoints and k == 1:
            kind = PIN_LO
        elif fix_endpoints and k == K:
            kind = PIN_HI
        jlo = k if k < K else n  # the last row is only needed at j = n
        jhi = n - (K - k)  # leave one bin for each later group
        cur[:] = inf
        top = 0
        stack[0, 0] = jlo
        stack[0, 1] = jhi
        stack[0, 2] = k - 1
        stack[0, 3] = jhi - 1
        top = 1
        while top > 0:
            top -= 1
            a = stack[top, 0]
            b = stack[top, 1]
            lo = stack[top, 2]
            hi = stack[top, 3]
            if a > b:
                continue
            m = (a + b) // 2
            best = inf
            besti = lo
            last = min(hi, m - 1)
            for i in range(lo, last + 1):
                v = prev[i] + _group_cost(pw, pwx, pwx2, i, m, kind)
                if v < best:
                    best = v
                    besti = i
            cur[m] = best
            arg[k, m] = besti
            stack[top, 0] = m + 1
            stack[top, 1] = b
            stack[top, 2] = besti
            stack[top, 3] = hi
            stack[top + 1, 0] = a
            stack[top + 1, 1] = m - 1
            stack[top + 1, 2] = lo
            stack[top + 1, 3] = besti
            top += 2
        prev, cur = cur, prev
    bounds = np.empty(K + 1, dtype=np.int64)
    j = n
    bounds[K] = n
    for k in range(K, 0, -1):
        j = arg[k, j]
        bounds[k - 1] = j
    return bounds, prev[n]
