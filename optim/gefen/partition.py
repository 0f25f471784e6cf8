"""Block length of the shared second moment, chosen once from a tensor's first squared gradients.

Gefen needs no parameter names: the block length P (a divisor of the flattened tensor's numel) is
read off g**2. Two rules, selectable by name:

``"adjacent_log"`` (default; upstream ``gefen`` 's current rule, ``gefen/partitioning.py``)
    Over the divisors p of n that leave at least ``MIN_BLOCKS`` = 4 blocks, in increasing order,
    ``score(p) = mean_b |mean(log(g**2 + 1e-12) over block b) - the same over block b + 1|``.
    Candidates are strict local maxima of the score sequence (both neighbours lower) with
    ``8 < p < the largest divisor``; P is the candidate of highest score (ties: larger p); P = 1
    when there is none. A structured tensor (rows of different gradient scale) scores high at its
    row length, where adjacent blocks are different rows, and lower just below and above it.
``"variance_drop"`` (the paper-era rule)
    ``W(p)`` = mean over blocks of the unbiased variance of log(g**2 + 1e-12) inside a block
    (on raw g**2 the heavy tail hides row structure: a test tensor of rows with log-normal scales
    never reached a 25% drop), for the same
    candidates with p >= 2. P is the candidate with the largest relative drop
    ``1 - W(p) / W(p_next)`` from the next larger candidate: the longest block length before
    unrelated gradients start sharing a block. P = 1 when no drop reaches ``MIN_DROP`` = 0.25
    (upstream's unused ``threshold`` default): no structure, per-element v.

Both then cap P at ``MAX_BLOCK`` = 1024: a larger P is replaced by its largest divisor <= 1024
(upstream instead takes the smallest divisor of P above 1024; the cap keeps a block in one
Triton program). Tensors with fewer than 2 * MIN_BLOCKS elements, and primes, get P = 1: per-element
v, first-moment scales over chunks of 256 (``reference.CHUNK``), so they never cost more than
AdamW's per-element second moment plus one byte.

With the factored second moment (``Gefen(layout="factored")``) a tensor of two or more
dimensions, seen as the matrix (shape[0], row) with row = numel / shape[0] (a Linear weight, an
embedding table, a conv weight by fan-in), takes ``factored_block(P, shape)``, the largest divisor of
row that is <= P (P itself when P divides row, row when P is a multiple of it): each block then
lies inside one row and offset j of every block covers the same columns, so the
per-offset factor is a column factor. Where P spans several whole rows (an embedding whose rows,
tokens of different frequency, share one v) it becomes one row, and the factored estimate is
Adafactor's row-by-column one exactly.

Limit of any block rule: blocks are contiguous in the flattened (row-major) tensor, so at P >= 2
they group a weight matrix's neighbouring columns, never one column across rows. On
experiments/gefen_memory.py's character model the second moment of the attention and first
feed-forward matrices varies mostly by column (input feature), not in runs of neighbouring columns,
and sharing v there is what costs loss against AdamW (``experiments/gefen_ablation.py``; section
"Gefen: where the loss gap comes from (ablation)" of ``results/README.md``).
"""

import math

import torch

MIN_BLOCKS = 4
MAX_BLOCK = 1024
MIN_CANDIDATE = 8  # a local maximum must have p > 8 (upstream)
LOG_EPS = 1e-12
MIN_DROP = 0.25
RULES = ("adjacent_log", "variance_drop")


def divisors(n: int) -> list:
    """All positive divisors of n, ascending."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def cap_block(p: int, cap: int = MAX_BLOCK) -> int:
    """Largest divisor of p that is <= cap."""
    if p <= cap:
        return p
    return max(d for d in divisors(p) if d <= cap)


def _candidates(n: int) -> list:
    return [d for d in divisors(n) if n // d >= MIN_BLOCKS]


CHUNK = 1 << 16  # most elements of log-squared gradient held at once while scoring (see _chunk_length)


def _logs(part: torch.Tensor) -> torch.Tensor:
    """log(g**2 + 1e-12) in float64 of a piece of the flat gradient (g**2 in fp32, as upstream)."""
    x = part.float()
    return torch.log((x * x).double() + LOG_EPS)


def _chunk_length(n: int, cands: list) -> int:
    """The divisor of n up to ``chunk_limit(n)`` that the most candidates divide (the longest of those)."""
    limit = chunk_limit(n)
    return max((d for d in divisors(n) if d <= limit), key=lambda d: (sum(d % p == 0 for p in cands), d))


def chunk_limit(n: int) -> int:
    """Elements scored at once for an n-element tensor: ``CHUNK``, or n / 64 for a smaller tensor,
    so the scoring's temporaries (about 60 bytes an element of a chunk) stay under the bytes of the
    gradient itself, bf16 included."""
    return max(256, min(CHUNK, n // 64))


def _block_sums(flat: torch.Tensor, cands: list, squares: bool):
    """{p: (sums, sums of squares or None)} of log g**2 over consecutive blocks of each p, a chunk at
    a time: yields one such dict per chunk, blocks in order, so the logs of at most about ``CHUNK``
    elements are alive at once.

    Candidates that divide the chunk length share one pass over the tensor (each p reuses the
    sums of its largest listed divisor); every other p takes its own pass, over chunks of whole
    blocks, or, for a block longer than a chunk, summing each block over chunks.
    """
    n = flat.numel()
    L = _chunk_length(n, cands)
    shared = [p for p in cands if L % p == 0]
    for a in range(0, n, L):
        x = _logs(flat[a:a + L])
        out = {}
        for which, src in ((0, x), (1, x * x if squares else None)):
            if src is None:
                continue
            done = {}
            for p in shared:
                base = max((d for d in done if p % d == 0), default=None)
                prev = src if base is None else done[base]
                done[p] = prev if p == (base or 1) else prev.view(-1, p // (base or 1)).sum(dim=1)
            for p in shared:
                out.setdefault(p, [None, None])[which] = done[p]
        yield out
    for p in cands:
        if p in shared:
            continue
        limit = chunk_limit(n)
        if p <= limit:
            step = p * max(1, limit // p)
            for a in range(0, n, step):
                x = _logs(flat[a:a + step])
                yield {p: [x.view(-1, p).sum(dim=1), (x * x).view(-1, p).sum(dim=1) if squares else None]}
            continue
        s1 = torch.zeros(n // p, dtype=torch.float64, device=flat.device)
        s2 = torch.zeros_like(s1) if squares else None
        for a in range(0, n, limit):  # at most two blocks meet in a chunk (p > limit)
            x = _logs(flat[a:a + limit])
            lo, end = a, a + x.numel()
            while lo < end:
                b = lo // p
                hi = min((b + 1) * p, end)
                seg = x[lo - a:hi - a]
                s1[b] += seg.sum()
                if squares:
                    s2[b] += (seg * seg).sum()
                lo = hi
        yield {p: [s1, s2]}


def adjacent_log_scores(g: torch.Tensor, cands: list) -> list:
    """upstream's score(p) for each candidate p (float64): the mean over neighbouring blocks of the
    absolute difference of their mean log g**2."""
    total = dict.fromkeys(cands, 0.0)
    last = dict.fromkeys(cands)
    for part in _block_sums(g.reshape(-1), cands, squares=False):
        for p, (s1, _) in part.items():
            means = s1 / p
            if last[p] is not None:
                means = torch.cat([last[p].view(1), means])
            total[p] += float(means.diff().abs().sum())
            last[p] = means[-1]
    n = g.numel()
    return [total[p] / (n // p - 1) for p in cands]


def choose_adjacent_log(g: torch.Tensor) -> int:
    n = g.numel()
    cands = _candidates(n)
    if len(cands) < 3:
        return 1
    scores = adjacent_log_scores(g, cands)
    best = None
    for i in range(1, len(cands) - 1):
        p, s = cands[i], scores[i]
        if p <= MIN_CANDIDATE or s <= scores[i - 1] or s <= scores[i + 1]:
            continue
        if best is None or (s, p) > best:
            best = (s, p)
    return 1 if best is None else best[1]


def within_block_variances(g: torch.Tensor, cands: list) -> list:
    """W(p): mean over blocks of the unbiased within-block variance of log(g**2 + 1e-12), p >= 2."""
    total = dict.fromkeys(cands, 0.0)
    for part in _block_sums(g.reshape(-1), cands, squares=True):
        for p, (s1, s2) in part.items():
            total[p] += float(((s2 - s1 * s1 / p) / (p - 1)).clamp_min(0).sum())
    n = g.numel()
    return [total[p] / (n // p) for p in cands]


def choose_variance_drop(g: torch.Tensor) -> int:
    cands = [p for p in _candidates(g.numel()) if p > 1]
    if len(cands) < 2:
        return 1
    w = within_block_variances(g, cands)
    drops = [1.0 - w[i] / w[i + 1] if w[i + 1] > 0 else 0.0 for i in range(len(cands) - 1)]
    best = max(range(len(drops)), key=lambda i: (drops[i], cands[i]))
    return cands[best] if drops[best] >= MIN_DROP else 1


def constant_magnitude(grad: torch.Tensor) -> bool:
    """True if every element of ``grad`` has the same |g| (g**2 constant: every block length gives the
    same block means, so the gradient says nothing about blocks). Read a chunk at a time."""
    flat = grad.detach().reshape(-1)
    first = None
    for a in range(0, flat.numel(), CHUNK):
        lo, hi = flat[a:a + CHUNK].abs().aminmax()
        lo, hi = float(lo), float(hi)
        if lo != hi or (first is not None and lo != first):
            return False
        first = lo
    return first is not None


def provisional_block(n: int) -> int:
    """The block length of a tensor whose gradients have had one magnitude: the longest a rule could
    choose (the cheapest state), 1 where there is no choice."""
    cands = [p for p in _candidates(n) if MIN_CANDIDATE < p]
    return cap_block(max(cands)) if cands else 1


def choose_block(grad: torch.Tensor, rule: str = "adjacent_log") -> int:
    """Block length P for a tensor from its first gradient (any shape, any float dtype)."""
    g = grad.detach().reshape(-1)
    if rule == "adjacent_log":
        p = choose_adjacent_log(g)
    elif rule == "variance_drop":
        p = choose_variance_drop(g)
    else:
        raise ValueError(f"Gefen: unknown block rule {rule!r}; choose one of {RULES}")
    return cap_block(p)


def factored_block(p: int, shape) -> int:
    """Block length with the factored second moment: for a tensor of two or more dimensions the
    largest divisor of its row length ``numel / shape[0]`` that is <= ``p`` (the longest blocks inside
    one row of its matrix view), ``p`` otherwise."""
    shape = tuple(shape)
    if len(shape) < 2 or math.prod(shape) == 0:
        return p
    return cap_block(math.prod(shape) // shape[0], cap=p)


def factor_tiles(shape, block: int, whole: bool = False) -> list[tuple[int, int]]:
    """Row ranges ``(r0, r1)`` of the tiles of the factored second moment, each tile with its own
    per-offset factor w. A matrix view (R, C) (``shape[0]`` rows of ``numel / shape[0]``) with
    ``block`` > 1 and more rows than C is cut into tiles of C rows (C + 1 when C is odd, so that no
    byte of 4-bit codes spans two tiles), the last holding what is left: each square tile is
    Adafactor's row-by-column estimate on its own, so the parts of a fused projection (q, k and
    v stacked in one (3C, C) weight, as ``nn.MultiheadAttention`` and nanoGPT keep them) get a
    column factor each instead of one for all. Otherwise, or with ``whole`` (one column factor for
    the whole matrix, Adafactor's and Gefen-X's: ``whole_matrix_factor``), one tile of every row;
    ``[(0, 1)]`` for a tensor of fewer than two dimensions."""
    shape = tuple(shape)
    if len(shape) < 2 or math.prod(shape) == 0:
        return [(0, 1)]
    rows = shape[0]
    height = math.prod(shape) // rows
    height += height % 2
    if block == 1 or rows <= height or whole:
        return [(0, rows)]
    return [(r, min(r + height, rows)) for r in range(0, rows, height)]


def tile_elements(shape, block: int, whole: bool = False) -> list[tuple[int, int]]:
    """``factor_tiles`` as ranges ``(first, end)`` of the flattened tensor's elements (``[(0, 0)]``
    for an empty one, such as a local shard without rows)."""
    shape = tuple(shape)
    n = math.prod(shape)
    row = n // shape[0] if len(shape) >= 2 and n else n
    return [(r0 * row, r1 * row) for r0, r1 in factor_tiles(shape, block, whole)]



SCALE_ELEMENTS = 2048  # most elements one first-moment scale of row groups spans (Gefen-X's fallback block)


def scale_group_elements(option) -> int:
    """The most elements one first-moment scale spans under ``row_group_scales=option``: an int is
    that bound, True ``SCALE_ELEMENTS``."""
    return SCALE_ELEMENTS if option is True else int(option)


def row_group_scale_length(block: int, shape, whole: bool = False, most: int = SCALE_ELEMENTS) -> int:
    """Length S of the first moment's scale blocks of a factored matrix with one scale per group of
    whole rows (``row_group_scales``): the longest multiple of ``block`` (a row, or a divisor of one)
    that is at most ``most`` (at least ``block``) and divides the elements of every factor tile
    (``tile_elements``; ``whole`` as there), so that no scale block spans two tiles and v blocks lie whole inside scale
    blocks. ``block`` itself for a tensor of fewer than two dimensions or ``block`` 1."""
    if block <= 1 or len(tuple(shape)) < 2:
        return block
    units = 0
    for a, b in tile_elements(shape, block, whole):
        units = math.gcd(units, (b - a) // block)
    return block * cap_block(units, cap=max(1, most // block)) if units else block
