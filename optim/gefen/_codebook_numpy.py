"""Level-synchronous divide-and-conquer DP for the optimal codebook in numpy; see ``codebook.py``.

The same optimum as ``_codebook_numba.dp_splits_numba``, for when numba is missing or not yet
loaded: each recursion depth is one vectorised pass over all pending intervals.
"""

import numpy as np


def dp_splits_numpy(pw, pwx, pwx2, levels, fix_endpoints):
    """Same contract as ``_codebook_numba.dp_splits_numba``; all intervals of one depth at once.

    For a fixed end j the group cost is S2(j) − S2(i) − (S1(j) − S1(i))² / (S0(j) − S0(i)) (mean
    level) or S2(j) − S2(i) − 2c(S1(j) − S1(i)) + c²(S0(j) − S0(i)) (pinned level c); the terms
    in j alone do not move the argmin, so the scan minimises prev(i) − S2(i) + (the rest) and adds
    S2(j) afterwards. This halves the array passes per depth.
    """
    n = pw.shape[0] - 1
    K = levels
    prev = np.full(n + 1, np.inf)
    prev[0] = 0.0
    arg = np.zeros((K + 1, n + 1), dtype=np.int64)
    big = n + 1
    for k in range(1, K + 1):
        kind = 1 if (fix_endpoints and k == 1) else 2 if (fix_endpoints and k == K) else 0
        jlo = k if k < K else n
        jhi = n - (K - k)
        cur = np.full(n + 1, np.inf)
        if kind == 0:
            base = prev - pwx2
        else:
            c = -1.0 if kind == 1 else 1.0
            base = prev - pwx2 + 2.0 * c * pwx - c * c * pw
        a, b = np.array([jlo]), np.array([jhi])
        lo, hi = np.array([k - 1]), np.array([jhi - 1])
        while a.size:
            m = (a + b) // 2
            cnt = np.minimum(hi, m - 1) - lo + 1  # >= 1: lo <= m - 1 always
            ends = np.cumsum(cnt)
            off = ends - cnt
            i = np.arange(ends[-1]) - np.repeat(off - lo, cnt)
            if kind == 0:
                d1 = np.repeat(pwx[m], cnt) - pwx[i]
                val = base[i] - d1 * d1 / (np.repeat(pw[m], cnt) - pw[i])
            else:
                val = base[i]
            segmin = np.minimum.reduceat(val, off)
            besti = np.minimum.reduceat(np.where(val == np.repeat(segmin, cnt), i, big), off)
            if kind == 0:
                cur[m] = segmin + pwx2[m]
            else:
                cur[m] = segmin + pwx2[m] - 2.0 * c * pwx[m] + c * c * pw[m]
            arg[k, m] = besti
            keep_l = a <= m - 1
            keep_r = m + 1 <= b
            a = np.concatenate([a[keep_l], (m + 1)[keep_r]])
            b = np.concatenate([(m - 1)[keep_l], b[keep_r]])
            lo = np.concatenate([lo[keep_l], besti[keep_r]])
            hi = np.concatenate([besti[keep_l], hi[keep_r]])
        prev = cur
    bounds = np.empty(K + 1, dtype=np.int64)
    bounds[K] = j = n
    for k in range(K, 0, -1):
        j = arg[k, j]
        bounds[k - 1] = j
    return bounds, prev[n]
