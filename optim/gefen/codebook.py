"""Gefen's model-wide codebook: histogram, exact optimal levels, nearest-code lookup.

Three pieces, used once per model (``histogram``, ``optimal_codebook``) and every step
(``nearest_code``):

``histogram(values, bins=HIST_BINS)``
    Counts of block-normalised values over ``bins`` equal bins on [-1, 1], binned exactly as
    upstream ``gefen`` does: ``floor((x + 1) / (2 / bins))``, values outside [-1, 1] clamped into
    the end bins. Returns ``(centers, counts)``.

``optimal_codebook(centers, counts, levels, fix_endpoints=True) -> (codebook, cost)``
    The exact optimum of weighted 1-D k-means over histogram bins, as upstream ``gefen``'s
    ``quantization.exact_dp`` defines it: the occupied bins (count > 0), sorted, are split into
    ``levels`` contiguous non-empty groups; each group's level is its weighted mean, except that
    with ``fix_endpoints`` the first group is costed against the level -1 and the last against +1
    (they are non-empty even where their bins would be nearer another level). ``cost`` is the
    minimum of  sum_groups sum_bins count·(center − level)²  (float64, a Python float); it is an
    upper bound of the error of quantising the histogram to the returned codebook by nearest
    level. Upstream solves it in O(B²K); here the rows of the DP are filled by divide and conquer
    over the Monge property, O(K·B·log B), compiled with numba (``_codebook_numba.py``) or
    level-synchronous in numpy (``_codebook_numpy.py``); ``backend`` chooses.

    Fewer occupied bins than levels: upstream's objective has no feasible partition then (upstream
    pads the codebook ad hoc). We return the optimum of the nearest-level objective instead (every
    bin to its nearest level, ±1 among the levels when ``fix_endpoints``): every occupied centre
    becomes a level and the cost is 0, except when the ends are pinned and exactly ``levels − 1``
    centres lie strictly inside (−1, 1); then the cheapest of "first bin to −1", "last bin to +1"
    or "merge two neighbouring bins" is taken. The remaining levels are filled with distinct
    values: first −1 and +1 if absent, then repeatedly the midpoint of the widest gap. A single
    occupied bin is the extreme case of this rule.

``code_table(codebook)`` and ``nearest_code(x, codebook_or_table, dtype=torch.int64)``
    Index of the nearest codebook entry to each element (ties go to the lower index; a repeated
    entry keeps its first index), exact for float32 and float64 inputs, through the one lookup
    table that every fast path of the step reads (``CodeTable``; see ``code_table``).
    ``stochastic_code(x, table, words)`` rounds to one of the two entries around x instead, at
    random and unbiased (``reference.stochastic_round``), through the same table.
"""

from __future__ import annotations

import heapq
import sys
from typing import NamedTuple

import numpy as np
import torch

from ._codebook_numpy import dp_splits_numpy as _dp_splits_numpy

__all__ = ["HIST_BINS", "histogram", "optimal_codebook", "code_boundaries", "code_table", "CodeTable",
           "nearest_code", "stochastic_code"]

HIST_BINS = 4096  # bins of the codebook's histogram on [-1, 1] (upstream: 16 per 8-bit level)

_BACKENDS = ("auto", "numba", "numpy")
_NUMBA_MIN_WORK = 1 << 21  # bins x levels above which "auto" uses numba even when not yet imported


# ----------------------------------------------------------------------------------------------
# histogram


def histogram(values, bins: int = HIST_BINS):
    """Histogram of values on [-1, 1] with ``bins`` equal bins -> (centers float32, counts int64).

    ``values``: a floating tensor of any shape, or an iterable of them (summed into one
    histogram, e.g. every parameter's block-normalised gradient). Bin of x:
    ``floor((x + 1) / (2 / bins))`` clamped to [0, bins − 1] (upstream gefen's rule; x = 1 lands in
    the last bin, values outside [-1, 1] in the end bins). Counts are exact int64 on the CPU.
    """
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or bins < 1:
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    bins = int(bins)
    tensors = [values] if isinstance(values, torch.Tensor) else list(values)
    counts = torch.zeros(bins, dtype=torch.int64)
    bin_width = 2.0 / float(bins)
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point()):
            raise TypeError(f"values must be floating-point tensors, got {type(t).__name__}"
                            f"{'' if not isinstance(t, torch.Tensor) else ' of dtype ' + str(t.dtype)}")
        x = t.detach().reshape(-1)
        if x.numel() == 0:
            continue
        if x.dtype != torch.float64:
            x = x.float()
        if torch.isnan(x).any():
            raise ValueError("values contain NaN; the histogram of a codebook needs finite values "
                             "(check the gradients of the first step)")
        idx = torch.floor((x + 1.0) / bin_width).clamp_(0, bins - 1).to(torch.int64)
        counts += torch.bincount(idx, minlength=bins).cpu()
    k = torch.arange(bins, dtype=torch.float64)
    centers = (-1.0 + (2.0 * k + 1.0) / bins).to(torch.float32)
    return centers, counts


# ----------------------------------------------------------------------------------------------
# the DP (numpy: _codebook_numpy.py, numba: _codebook_numba.py)


def _numba_dp():
    from optim.gefen._codebook_numba import dp_splits_numba

    return dp_splits_numba


# ----------------------------------------------------------------------------------------------
# optimal codebook


def _as_f64(x, name):
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a 1-D tensor or array of numbers ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} must be finite; found NaN or inf")
    return arr


def _fill_levels(required: np.ndarray, levels: int) -> np.ndarray:
    """``required`` (sorted, distinct) plus distinct fillers up to ``levels`` values."""
    pts = sorted(set(required.tolist()))
    for end in (-1.0, 1.0):
        if len(pts) < levels and end not in pts:
            pts.append(end)
    pts.sort()
    gaps = [(-(hi - lo), lo, hi) for lo, hi in zip(pts[:-1], pts[1:])]
    heapq.heapify(gaps)
    while len(pts) < levels:
        _, lo, hi = heapq.heappop(gaps)
        mid = 0.5 * (lo + hi)
        pts.append(mid)
        heapq.heappush(gaps, (-(mid - lo), lo, mid))
        heapq.heappush(gaps, (-(hi - mid), mid, hi))
    return np.sort(np.asarray(pts, dtype=np.float64))


def _few_bins(x, w, levels, fix_endpoints):
    """Optimum of the nearest-level objective when fewer bins are occupied than levels."""
    if not fix_endpoints:
        return _fill_levels(x, levels), 0.0
    required = np.unique(np.concatenate([x, [-1.0, 1.0]]))
    if required.size <= levels:
        return _fill_levels(required, levels), 0.0
    # exactly levels - 1 bins, none at ±1: one of them must give up its own level
    options = [(w[0] * (x[0] + 1.0) ** 2, "lo", 0), (w[-1] * (x[-1] - 1.0) ** 2, "hi", 0)]
    if x.size > 1:
        merge = w[:-1] * w[1:] / (w[:-1] + w[1:]) * (x[1:] - x[:-1]) ** 2
        t = int(np.argmin(merge))
        options.append((merge[t], "merge", t))
    cost, how, t = min(options, key=lambda o: o[0])
    if how == "lo":
        lv = x[1:]
    elif how == "hi":
        lv = x[:-1]
    else:
        mean = (w[t] * x[t] + w[t + 1] * x[t + 1]) / (w[t] + w[t + 1])
        lv = np.concatenate([x[:t], [mean], x[t + 2:]])
    return np.concatenate([[-1.0], lv, [1.0]]), float(cost)


def _dp_levels(x, w, levels, fix_endpoints, backend):
    """Levels and cost of the optimal partition of >= ``levels`` occupied bins (sorted x)."""
    pw = np.concatenate([[0.0], np.cumsum(w)])
    pwx = np.concatenate([[0.0], np.cumsum(w * x)])
    pwx2 = np.concatenate([[0.0], np.cumsum(w * x * x)])
    # "auto": loading numba (and its on-disk cache) costs more than the numpy DP below
    # _NUMBA_MIN_WORK, so small problems stay in numpy unless numba is already loaded
    # (experiments/codebook_dp.py times both)
    small = x.size * levels < _NUMBA_MIN_WORK and "numba" not in sys.modules
    dp = _dp_splits_numpy
    if backend == "numba" or (backend == "auto" and not small):
        try:
            dp = _numba_dp()
        except ImportError:
            if backend == "numba":
                raise ImportError("backend='numba' needs the numba package (pip install numba), "
                                  "or use backend='numpy'") from None
    bounds, _ = dp(pw, pwx, pwx2, levels, bool(fix_endpoints))
    bounds = np.asarray(bounds, dtype=np.int64)
    lv = (pwx[bounds[1:]] - pwx[bounds[:-1]]) / (pw[bounds[1:]] - pw[bounds[:-1]])
    if fix_endpoints:
        lv[0], lv[-1] = -1.0, 1.0
    # cost recomputed bin by bin (no cancellation of prefix-sum differences)
    group = np.repeat(np.arange(levels), np.diff(bounds))
    return lv, float(np.sum(w * (x - lv[group]) ** 2))


def optimal_codebook(centers, counts, levels: int, fix_endpoints: bool = True, *, backend: str = "auto"):
    """Exact optimal ``levels``-level codebook of a histogram -> (codebook, cost).

    Args:
        centers: bin centres (1-D; sorted or not; duplicates are merged). Bins with count 0 are
            ignored.
        counts: non-negative weights of the bins, same length as ``centers``.
        levels: number of codebook entries (256 for 8-bit codes, 16 for 4-bit).
        fix_endpoints: pin the first and last levels at -1 and +1 (Gefen's default; block-absmax
            normalised values always reach ±1). (Default: True)
        backend: "numba" (compiled), "numpy" (pure fallback) or "auto": numba if importable and
            either already imported or occupied bins x levels >= 2^21 (8192 x 256), else numpy
            (cheaper for one call in a fresh process). (Default: "auto")

    Returns:
        ``codebook``: sorted float32 tensor of exactly ``levels`` values, on ``centers``' device
        when it is a tensor (else the CPU); ``cost``: the optimal objective (module docstring),
        a Python float.
    """
    if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)) or levels < 1:
        raise ValueError(f"levels must be a positive integer, got {levels!r}")
    levels = int(levels)
    if fix_endpoints and levels < 2:
        raise ValueError(f"levels must be >= 2 with fix_endpoints=True (two levels are pinned at "
                         f"-1 and +1), got {levels}; pass fix_endpoints=False for a single level")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    device = centers.device if isinstance(centers, torch.Tensor) else torch.device("cpu")
    x = _as_f64(centers, "centers")
    w = _as_f64(counts, "counts")
    if x.shape != w.shape:
        raise ValueError(f"centers and counts must have the same length, got {x.size} and {w.size}")
    if (w < 0).any():
        raise ValueError("counts must be non-negative")
    if fix_endpoints and ((x < -1.0) | (x > 1.0))[w > 0].any():
        raise ValueError("centers must lie in [-1, 1] with fix_endpoints=True (the levels pinned at ±1 are "
                         "the ends of the code); normalise the values first or pass fix_endpoints=False")
    occupied = w > 0
    if not occupied.any():
        raise ValueError("counts has no positive entry: the histogram is empty, nothing to fit a "
                         "codebook to (did the first step see any gradient?)")
    x, inv = np.unique(x[occupied], return_inverse=True)
    w = np.bincount(inv.reshape(-1), weights=w[occupied], minlength=x.size)
    n = x.size

    if n < levels:
        lv, cost = _few_bins(x, w, levels, fix_endpoints)
    else:
        lv, cost = _dp_levels(x, w, levels, fix_endpoints, backend)
    codebook = torch.from_numpy(np.sort(lv).astype(np.float32)).to(device)
    return codebook, cost


# ----------------------------------------------------------------------------------------------
# nearest-code lookup

# Every fast path computes a value's table bin as floor((x + 1) * nlut / 2) in fp32. For |x| <= 1
# that is off the exact bin position by at most 2^-22 in x units (one rounding of x + 1 in [0, 2],
# one of the product), so each bin is built over its edges widened by LUT_MARGIN = 2^-20 on both
# sides: whatever bin a value lands in, every boundary between it and that bin's start is among
# the bin's ``ncmp`` comparisons.
LUT_MARGIN = 2.0**-20
_LUT_BITS = range(10, 17)  # table sizes tried, 2^10 .. 2^16 bins, smallest with ncmp <= 1 kept


class CodeTable(NamedTuple):
    """Everything a nearest-code lookup needs, built once per codebook by ``code_table``.

    The table works on the distinct entries ``uniq``: u = ``lut[bin(x)]`` plus the number of
    ``boundaries[u], boundaries[u + 1], ...`` below x (``ncmp`` comparisons at most) is the
    nearest distinct entry; ``first[u]`` / ``last[u]`` are its first and last index in the
    codebook (they differ only for repeated entries).
    """

    codebook: torch.Tensor  # (levels,) float32, sorted
    uniq: torch.Tensor  # (u,) float32, the distinct entries
    boundaries: torch.Tensor  # (u,) float32 midpoints of uniq rounded down, then +inf
    boundaries64: torch.Tensor  # (u,) the exact float64 midpoints, then +inf
    lut: torch.Tensor  # (nlut,) int64, #{boundaries < left edge of the bin - LUT_MARGIN}
    lut_bound: torch.Tensor  # (nlut,) float32 boundaries[lut]: the comparison when ncmp <= 1
    lut_bound64: torch.Tensor  # the same in float64, for float64 inputs
    ncmp: int  # most boundaries inside one widened bin
    scale: float  # nlut / 2: bin of x is floor((x + 1) * scale)
    first: torch.Tensor  # (u,) int64 first codebook index of each distinct entry
    last: torch.Tensor  # (u,) int64 last codebook index of each distinct entry

    @property
    def has_repeats(self) -> bool:
        return self.uniq.numel() < self.codebook.numel()


def _check_codebook(codebook):
    if not isinstance(codebook, torch.Tensor) or codebook.dim() != 1 or codebook.numel() < 1:
        raise ValueError("codebook must be a non-empty 1-D tensor")
    if not codebook.is_floating_point() or not torch.isfinite(codebook).all():
        raise ValueError("codebook must hold finite floating-point values")
    if codebook.numel() > 1 and (codebook[1:] < codebook[:-1]).any():
        raise ValueError("codebook must be sorted ascending (optimal_codebook returns it sorted)")


def code_boundaries(codebook: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Decision boundaries of nearest-entry quantisation: code(x) = #{i : boundaries[i] < x}.

    ``boundaries[i]`` is the midpoint of ``codebook[i]`` and ``codebook[i + 1]`` (exact in
    float64), rounded down to ``dtype``; for x of that dtype this reproduces the exact argmin of
    |x − c| with ties to the lower index.
    """
    _check_codebook(codebook)
    c = codebook.detach().to("cpu", torch.float64)
    mid = 0.5 * (c[:-1] + c[1:])  # exact: codebook entries are at most float32 here
    if (c[1:] == c[:-1]).any():  # a repeated entry is never chosen: its boundary is the next one
        mid = mid.masked_fill(c[1:] == c[:-1], float("inf")).flip(0).cummin(0).values.flip(0)
    if dtype == torch.float64:
        return mid.to(codebook.device)
    low = mid.to(dtype)
    above = low.double() > mid
    low = torch.where(above, torch.nextafter(low, torch.tensor(-float("inf"), dtype=dtype)), low)
    return low.to(codebook.device)


def code_table(codebook: torch.Tensor) -> CodeTable:
    """The lookup table of ``codebook`` over the fewest 2^p uniform bins of [-1, 1] (10 <= p <= 16)
    that hold at most one boundary each; 2^16 bins with ``ncmp > 1`` where none does."""
    _check_codebook(codebook)
    cb = codebook.detach().float()
    dev = cb.device
    uniq = torch.unique_consecutive(cb)
    inf = torch.tensor([float("inf")], dtype=torch.float32, device=dev)
    bnd = torch.cat([code_boundaries(uniq, torch.float32), inf])
    bnd64 = torch.cat([code_boundaries(uniq, torch.float64), inf.double()])
    b = bnd64[:-1].cpu().numpy()
    for p in _LUT_BITS:
        nlut = 1 << p
        edges = -1.0 + 2.0 * np.arange(nlut + 1) / nlut
        lo, hi = edges[:-1] - LUT_MARGIN, edges[1:] + LUT_MARGIN
        lo[0], hi[-1] = -np.inf, np.inf  # the end bins also take everything outside [-1, 1]
        lut = np.searchsorted(b, lo, side="left")  # #{b < lo}
        ncmp = int((np.searchsorted(b, hi, side="right") - lut).max())  # most b in [lo, hi]
        if ncmp <= 1:
            break
    lut = torch.from_numpy(lut.astype(np.int64)).to(dev)
    first = torch.searchsorted(cb, uniq, side="left")
    last = torch.searchsorted(cb, uniq, side="right") - 1
    return CodeTable(cb, uniq, bnd, bnd64, lut, bnd[lut], bnd64[lut], ncmp, nlut / 2.0, first, last)


def nearest_code(x: torch.Tensor, codebook, dtype=torch.int64) -> torch.Tensor:
    """Index of the nearest entry of ``codebook`` (a sorted tensor or a ``CodeTable``) per element.

    Ties go to the lower index; exact for float32/float64 x (bf16/fp16 are upcast to float32,
    which is exact). Values outside [-1, 1] get the nearest end entry as usual. NaN gets the last
    entry's code (as the reference's searchsorted orders NaN last). Returns a tensor of x's shape and ``dtype`` (use torch.uint8 to store 8-bit
    codes; decode with ``codebook[codes.long()]``, since a uint8 index is read as a mask).
    """
    table = codebook if isinstance(codebook, CodeTable) else code_table(codebook)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("x must be a floating-point tensor")
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    levels = table.codebook.numel()
    if dtype.is_floating_point or dtype == torch.bool or (dtype == torch.uint8 and levels > 256) or (
            dtype == torch.int8 and levels > 128):
        raise ValueError(f"dtype {dtype} cannot hold codes 0..{levels - 1}; use torch.uint8 (<= 256 levels), "
                         "torch.int32 or torch.int64")
    u = _nearest_distinct(xf, table)
    return (u if not table.has_repeats else table.first[u]).to(dtype)


def _nearest_distinct(xf: torch.Tensor, table: CodeTable) -> torch.Tensor:
    """Index into ``table.uniq`` of the nearest distinct entry of each element of float32 or
    float64 ``xf`` (int64)."""
    f64 = xf.dtype == torch.float64
    if table.ncmp > 1:  # entries closer than the finest table separates: binary search
        return torch.bucketize(xf, (table.boundaries64 if f64 else table.boundaries)[:-1])
    # u = lut[bin] + (x > boundaries[lut[bin]]): two gathers with one index
    s = table.scale
    top = table.lut.numel() - 1  # NaN takes the last bin: the reference's searchsorted puts it last
    b = torch.mul(xf, s).add_(s).nan_to_num_(nan=top).clamp_(0, top).to(torch.int64)
    return table.lut[b].add_(xf > (table.lut_bound64 if f64 else table.lut_bound)[b])


def stochastic_code(x: torch.Tensor, table: CodeTable, words: torch.Tensor) -> torch.Tensor:
    """``reference.stochastic_round`` through the lookup table (int64 codes, x's shape): the lower
    or upper of the two entries around each element of float32 ``x``, the upper with probability
    ``(x - lo) / (hi - lo)`` against the uniform ``(word >> 8) * 2**-24`` of its random word
    (``words``, int64, x's shape), the same arithmetic, so the same codes.

    The nearest distinct entry u has the entries around x at (u, u + 1) where x >= uniq[u], else
    at (u - 1, u); the upper one clamped to [1, len(uniq) - 1]."""
    uniq = table.uniq
    u = _nearest_distinct(x, table)
    hi = (u + (x >= uniq[u])).clamp_(min=1).clamp_(max=uniq.numel() - 1)
    lo = (hi - 1).clamp_(min=0)
    c_lo = uniq[lo]
    up = (x - c_lo) / (uniq[hi] - c_lo)
    take = (words >> 8).float().mul_(2.0**-24) < up
    if table.has_repeats:
        hi, lo = table.first[hi], table.first[lo]
    return torch.where(take, hi, lo)


def refresh_due(step: int, every: int) -> bool:
    """True where step ``step`` (counted from 1) relearns the codebook: every ``every`` steps after
    the first, which learns it (steps 1 + every, 1 + 2 every, ...); never where ``every`` is 0."""
    return every > 0 and step > 1 and (step - 1) % every == 0


def code_map(old: torch.Tensor, new: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored codes' re-encoding when codebook ``old`` becomes ``new``: uint8 (256,) taking each
    code byte to the byte of the nearest entries of ``new`` to the entries of ``old`` it holds (one
    code a byte at 8 bits; two at 4, low nibble first). Both codebooks end at -1 and +1, which map
    to themselves, so a scale block's largest element keeps its value and the scales stay as they are."""
    idx = nearest_code(old.float(), new.float())
    if bits == 8:
        return idx.to(torch.uint8)
    byte = torch.arange(256, device=idx.device)
    return (idx[byte & 15] | (idx[byte >> 4] << 4)).to(torch.uint8)


# ----------------------------------------------------------------------------------------------
# one optimizer's codebook


class Codebook:
    """The model-wide codebook of one Gefen optimizer, and what it takes to learn and read it.

    Learned at the first step, from a histogram of every quantised parameter's gradients
    divided by their scale block's absmax (``histogram_of``; the step needs every gradient before
    then: ``needs_every_gradient``), as the exact ``2**bits``-level optimum with ends -1 and +1
    (``learn``), and again every so many steps where the optimizer asks (``relearn``, whose
    ``code_map`` re-encodes the stored codes). Every step reads it with its lookup table (``on``): one ``CodeTable`` for its own
    device and a copy of both per other device, kept until ``forget_copies``.

    ``block_histogram(grads, block=, bins=)`` counts block-normalised gradients of one block length
    (``tiling.histogram``; passed in, so this module depends on no step module).
    """

    def __init__(self, bits: int, block_histogram):
        self.bits = bits
        self.values = None  # fp32 (2**bits,) sorted, or None before it is learned
        self._block_histogram = block_histogram
        self._table = None
        self._copies = {}  # device -> (values, CodeTable) on a device other than its own

    def needs_every_gradient(self, param_groups) -> bool:
        """True while it is not learned and a group quantises its first moment."""
        return self.values is None and any(g["quantize_first_moment"] and g["params"] for g in param_groups)

    def histogram_of(self, grads_by_block) -> torch.Tensor:
        """``HIST_BINS`` counts (int64, CPU) of ``{block length: [gradients]}`` normalised by block."""
        counts = torch.zeros(HIST_BINS, dtype=torch.int64)
        for block, gs in grads_by_block.items():
            counts += self._block_histogram(gs, block=block, bins=HIST_BINS).cpu()
        return counts

    def learn(self, counts: torch.Tensor, device=None) -> torch.Tensor:
        """Set the exact optimal ``2**bits``-level codebook (ends -1, +1) of a histogram; returns it."""
        counts = counts.cpu()
        if int(counts.sum()) == 0:  # all gradients zero: any codebook will do
            counts = counts.clone()
            counts[0] = counts[-1] = 1
        centers = histogram(torch.zeros(0, dtype=torch.float32), bins=counts.numel())[0]
        values, _ = optimal_codebook(centers, counts, 2**self.bits, fix_endpoints=True)
        self.set(values.float().to(device or "cpu"))
        return self.values

    def relearn(self, counts: torch.Tensor) -> torch.Tensor:
        """Learn a new codebook from ``counts`` (``learn``, on the current one's device) and return
        the ``code_map`` from the current one to it."""
        old = self.values
        self.learn(counts, old.device)
        return code_map(old, self.values, self.bits)

    def set(self, values: torch.Tensor) -> None:
        """Use ``values`` (``2**bits`` sorted values) as the codebook; None forgets it."""
        self._table, self._copies = None, {}
        if values is None:
            self.values = None
            return
        if values.numel() != 2**self.bits or not bool((values.diff() >= 0).all()):
            raise ValueError(f"Gefen: the codebook must be {2**self.bits} sorted values for "
                             f"bits={self.bits}, got shape {tuple(values.shape)}")
        self.values = values.detach().float().contiguous()

    def table(self) -> CodeTable:
        """The lookup table of the codebook on its own device."""
        if self._table is None or self._table.codebook.device != self.values.device:
            self._table = code_table(self.values)
        return self._table

    def on(self, device) -> tuple:
        """(codebook, its ``CodeTable``) on ``device``."""
        if self.values.device == device:
            return self.values, self.table()
        if device not in self._copies:
            values = self.values.to(device)
            self._copies[device] = (values, code_table(values))
        return self._copies[device]

    def forget_copies(self) -> None:
        """Drop the copies on other devices (what they were made from may be stale)."""
        self._copies = {}
