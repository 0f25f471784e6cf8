"""One Gefen step on one flattened tensor: short pure fp32 functions, readable against the rule.

Gefen (arXiv 2606.13894; upstream PyPI package ``gefen``, ``gefen/gefen.py``) is AdamW whose second
moment is shared inside blocks and whose first moment is stored as codes into one model-wide
codebook, scaled per block. Everything here is out of place and fp32; the in-place steps
(``torch_ops.py``, ``numba_ops.py``, ``triton_ops.py``) take a call's tensors as ``plan.Tile`` records
and its hyper-parameters as a ``plan.Hyper``, and are tested against :func:`gefen_step`.

State layout of one tensor (flattened, ``n = numel``; under FSDP the local shard)
---------------------------------------------------------------------------------
``block`` (int P >= 1)
    Block length of the shared second moment, chosen once from the first gradient
    (``partition.py``). P divides n. Element i belongs to v-block ``i // P``.
``v`` (fp32, shape ``(n // P,)``)
    One second moment per block: ``v_b <- beta2 * v_b + (1 - beta2) * mean_{i in b} g_i**2``.
    P == 1 is AdamW's per-element second moment.
scale blocks (length S)
    ``S = P`` when P > 1, else ``S = CHUNK = 256``. Element i belongs to scale block ``i // S``.
    (The optimizer's ``row_group_scales`` makes S a multiple of P instead, one scale per group of
    a factored matrix's rows: ``gefen_step``'s ``scale``; every function here that takes a
    ``block`` for the scales takes such an S in its place.)
    When n is not a multiple of S (only possible for P == 1), the last scale block is the partial
    chunk of the remaining ``n % S`` elements; no padding is stored and its absmax is over those
    elements only. So ``num_scales(n, P) == ceil(n / S)``.
``scales`` (fp32, shape ``(ceil(n / S),)``)
    ``s_j = max_{i in j} |m_i|`` of the updated first moment (0 for an all-zero block).
``codes`` (uint8)
    bits == 8: shape ``(n,)``, ``codes[i]`` is an index into ``codebook``.
    bits == 4: shape ``(ceil(n / 2),)``, two codes a byte: element ``2k`` in the low nibble,
    element ``2k + 1`` in the high nibble of ``codes[k]``; for odd n the last high nibble is 0
    (padding, never read).
    The first moment is ``m_i = codebook[code_i] * scales[i // S]``. Fresh state: codes 0 and
    scales 0, i.e. m = 0.
``w`` (fp32 or bf16, shape ``(P,)``; only with ``factor_second_moment=True``)
    Per-offset factor of the second moment: ``w_j`` is an EMA (same beta2) of the squared
    gradient at offset j inside a block, averaged over all blocks of the tensor. See
    "Factored second moment" below. Fresh state: zeros. (The optimizer keeps one such ``w`` per
    tile of a tall matrix and steps each tile as a tensor of this module; see below.) A bf16
    ``w`` (the optimizer's ``factor_dtype="bfloat16"``) is updated in fp32 and stored rounded
    stochastically (``factor_update``).
``codebook`` (fp32, shape ``(2**bits,)``, sorted ascending; learned with its ends pinned at -1, +1)
    One per model (all parameters, all groups), learned at the first optimizer step.
    ``codebook=None`` means the first moment is not quantised: ``codes`` is then the fp32 first
    moment itself (shape ``(n,)``) and ``scales`` an empty fp32 tensor.

The step (``step`` is t, counted from 1 for a tensor's first update)
--------------------------------------------------------------------
::

    v_b   <- beta2 * v_b + (1 - beta2) * mean_b(g**2)
    p     <- p * (1 - lr * weight_decay)
    m~    <- lerp(C[code] * s, g, 1 - beta1)          # = m + (1 - beta1) * (g - m)
    s_j   <- max_j |m~|;  code <- nearest(C, m~ / s_j)  (0 where s_j == 0)
    m^    <- C[code] * s_j                            # the stored, quantised first moment
    p     <- p - (lr / (1 - beta1**t)) * m^ / (sqrt(v_b) / sqrt(1 - beta2**t) + eps)

With ``bound`` (the optimizer's ``bound_first_moment``; :func:`moment_bound`) the stored m^ of each
element is clipped, for the last line only, to ``|m^| <= bound * sqrt(u_i)``, where ``u_i`` is the
least upper bound the state holds on the element's own second moment (:func:`own_moment_cap`): its v
where v is per element; ``P v_b`` where P elements share v_b (v_b is their mean square); under the
factor also ``n_b w_j`` (w_j is the mean over the n_b blocks of offset j), so ``min(P v_b, n_b w_j)``.
It is computed as ``K * sqrt(u_i) / sqrt(1 - beta2**t)`` with ``K = bound * sqrt(1 - beta2**t)`` in
fp32. AdamW's own moments satisfy it (Cauchy-Schwarz over the two EMAs), so the clip never acts on
an m AdamW could have; codes do not: the codebook has no 0, so an element whose m is 0 or tiny next
to its scale block's largest is stored as the smallest entry times that scale, which a v near 0 (a
row or a column no gradient reached) turns into a step of thousands of lr. Clipped, an element whose
row or column has no gradient does not move (as in AdamW), and no element moves more than
``bound * sqrt(u_i / v_i) * sqrt(1 - beta2**t) / (1 - beta1**t)`` lr a step, ``v_i`` the estimate in
its denominator (``u_i = v_i`` per element: AdamW's own bound). The estimate itself (``v_b r_j``) is
not a bound: an element above its row-by-column estimate is one AdamW has too.

``nearest`` is the closest codebook entry, ties to the lower index (upstream's rule). With
stochastic rounding of the codes (``seed`` given; the optimizer's ``first_moment_rounding``)
``stochastic_round`` takes its place: the lower or upper of the two entries around x = m~ / s,
upper with probability (x - C[lo]) / (C[hi] - C[lo]), so that E[C[code]] s = m~ (module
``_rounding``'s random words, element i of the tensor using word i of ``seed``). ``lerp`` is
torch's: ``m + w * (g - m)`` for ``w < 0.5``, else ``g - (g - m) * (1 - w)``. The last line is
written as ``p.addcdiv(m^, denom, value=-lr / bc1)``, the same arithmetic as
``torch.optim.AdamW``, so with P == 1 and ``codebook=None`` this is AdamW to rounding.

Factored second moment (``factor_second_moment=True``)
-----------------------------------------------------
A shared ``v_b`` is one number for a block whose elements can have squared gradients of very
different size (a block of a matrix row spans columns; columns differ). The factored estimate
of element ``(b, j)`` (block b, offset j in the block) is the rank-one product of the block's
mean and the offset's mean, normalised by the overall mean::

    w_j   <- beta2 * w_j + (1 - beta2) * mean_b(g[b, j]**2)      # P floats per tensor
    r_j   =  w_j / mean(w)          (r = 1 where mean(w) == 0)
    denom =  sqrt(v_b * r_j) / sqrt(1 - beta2**t) + eps

This is Adafactor's row-by-column estimate ``V ~ R C / sum(R)`` (Shazeer & Stern, 2018) with
Gefen's blocks as rows and offsets inside a block as columns: ``v_b`` is the row mean,
``w_j`` the column mean, ``mean(w)`` the overall mean (the bias corrections of ``w`` cancel
in ``r``). It costs P floats per tensor. With P == 1 (per-element v) ``r == 1`` exactly, so the
factor changes nothing and the reduction to AdamW holds. Blocks must be whole rows of
the same offsets: every block of a tensor has the same length P, so they are. The optimizer
also keeps a matrix's blocks inside its rows (``partition.factored_block``: P -> the largest divisor of the row
length that is <= P), so that offsets are columns and a block of whole rows becomes one row: then ``v_b`` is
Adafactor's row factor and ``w`` its column factor. A matrix of more rows than columns is
factored in square tiles of rows (``partition.factor_tiles``), each tile stepped as a tensor of
this module with its own ``w`` (the optimizer's state holds the tiles' ``w`` one after another):
q, k and v stacked in one weight do not share one column factor.
"""

import math

import numpy as np
import torch

from .._rounding import random_bits, round_stochastic

CHUNK = 256  # scale-block length for P == 1 tensors (upstream: largest divisor of n <= 256)


def scale_block_length(block: int) -> int:
    """Length S of the blocks that share one first-moment scale."""
    return block if block > 1 else CHUNK


def num_scales(numel: int, block: int) -> int:
    """Number of first-moment scales of an n-element tensor with v-block length ``block``."""
    s = scale_block_length(block)
    return -(-numel // s)


def num_code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else -(-numel // 2)


def block_absmax(x: torch.Tensor, length: int) -> torch.Tensor:
    """max |x| over consecutive blocks of ``length`` elements; a partial last block is allowed."""
    n = x.numel()
    pad = (-n) % length
    xp = torch.cat([x.abs(), x.new_zeros(pad)]) if pad else x.abs()
    return xp.view(-1, length).amax(dim=1)


def nearest(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codebook entry for each element, ties to the lower index (int64)."""
    k = codebook.numel()
    idx = torch.searchsorted(codebook, x)
    left = (idx - 1).clamp(0, k - 1)
    right = idx.clamp(0, k - 1)
    return torch.where((x - codebook[left]).abs() <= (x - codebook[right]).abs(), left, right)


def pack_codes(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-element indices -> stored uint8 codes (two a byte at 4 bits, low nibble first)."""
    c = idx.to(torch.uint8)
    if bits == 8:
        return c
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    c = c.view(-1, 2)
    return c[:, 0] | (c[:, 1] << 4)


def unpack_codes(codes: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Stored uint8 codes -> per-element indices (int64)."""
    if bits == 8:
        return codes.long()
    return torch.stack([codes & 15, codes >> 4], dim=1).view(-1)[:numel].long()


def stochastic_round(x: torch.Tensor, codebook: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Index of the lower or the upper of the two codebook entries around each element of ``x``,
    the upper with probability ``(x - C[lo]) / (C[hi] - C[lo])``, so that ``E[C[code]] = x``
    (int64). ``words``: one 32-bit random word per element (int64, ``_rounding.random_bits``); the
    upper is taken where ``(word >> 8) * 2**-24 < `` that probability. An exact hit has probability
    0 of moving (C[hi] = 1 probability 1): it keeps its entry. A repeated entry is written as its
    first index, as ``nearest`` writes it; outside [C[0], C[-1]] the end entry is taken."""
    k = codebook.numel()
    above = torch.searchsorted(codebook, x, right=True).clamp(1, k - 1)  # first entry above x
    hi = torch.searchsorted(codebook, codebook[above])
    lo = torch.searchsorted(codebook, codebook[above - 1])
    c_lo, c_hi = codebook[lo], codebook[hi]
    up = (x - c_lo) / (c_hi - c_lo)
    u = (words >> 8).float() * 2.0**-24
    return torch.where(u < up, hi, lo)


def quantize(m: torch.Tensor, codebook: torch.Tensor, *, block: int, bits: int, seed: int | None = None):
    """fp32 first moment -> (scales, codes): absmax per scale block, nearest entry of m / s, or with
    ``seed`` (32-bit) ``stochastic_round`` of it with the words of elements 0 .. n - 1 of ``seed``."""
    s_len = scale_block_length(block)
    scales = block_absmax(m, s_len)
    s = scales.repeat_interleave(s_len)[: m.numel()]
    q = torch.where(s > 0, m / s, torch.zeros_like(m))
    if seed is None:
        return scales, pack_codes(nearest(q, codebook), bits)
    words = random_bits(seed, 0, q.numel(), q.device)
    return scales, pack_codes(stochastic_round(q, codebook, words), bits)


def dequantize(scales, codes, codebook, *, numel: int, block: int, bits: int) -> torch.Tensor:
    """(scales, codes) -> fp32 first moment ``codebook[code] * scale``."""
    s_len = scale_block_length(block)
    s = scales.repeat_interleave(s_len)[:numel]
    return codebook[unpack_codes(codes, numel, bits)] * s


def moment_bound(beta1: float, beta2: float) -> float:
    """The largest ``|m_t| / sqrt(v_t)`` AdamW's moments reach at any step from zero state:
    ``(1 - beta1) / sqrt((1 - beta2) * (1 - beta1**2 / beta2))`` (Cauchy-Schwarz on the two EMAs
    of the same gradients; 7.27 at the default betas), or inf where ``beta1**2 >= beta2`` or
    ``beta2 >= 1`` (no bound)."""
    if beta2 >= 1 or beta1 * beta1 >= beta2:
        return math.inf
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2))


def bound_scale(bound: float, bc2_sqrt) -> float:
    """``K = bound * sqrt(1 - beta2**t)`` in fp32, from the fp32 ``bound`` and ``sqrt(1 - beta2**t)``,
    as every backend computes it: the clip of m^ is ``K * d`` (module doc)."""
    return float(np.float32(bound) * np.float32(bc2_sqrt))


def own_moment_cap(v, *, block, w=None):
    """``u``: per element, an upper bound on AdamW's second moment of the element from the state
    alone (fp32): ``v`` itself at block 1; ``P v_b`` for P elements sharing v_b (their mean square,
    same beta2); with the factor ``w`` also ``n_b w_j`` (offset j's mean square over the n_b blocks):
    the smaller. Every bound holds for each term of the EMAs, so for the EMAs."""
    if block == 1:
        return v.float()
    u = (v.float() * block).repeat_interleave(block)
    if w is None:
        return u
    cap = w.float() * v.numel()
    return torch.minimum(u.view(-1, block), cap.view(1, -1)).reshape(-1)


def clip_moment(m_hat: torch.Tensor, lim: torch.Tensor) -> torch.Tensor:
    """``m_hat`` with each element of magnitude above ``lim`` set to ``lim`` of its sign (NaN stays
    NaN; a NaN or inf ``lim`` clips nothing)."""
    return torch.where(m_hat.abs() > lim, lim.copysign(m_hat), m_hat)


def factor_update(w, g, *, block, beta2, seed=None):
    """New per-offset factor ``w`` (P floats) from gradient ``g``: EMA of ``mean_b(g[b, j]**2)``.

    The first thing a factored step does (before ``v``, which it does not depend on). An offset
    whose new value is not finite (a gradient of inf or NaN, or one whose square overflows) keeps
    its old value: one element must not set every other offset's ratio ``w_j / mean(w)`` to 0 for
    good. The element's own block is then frozen by its v, as without the factor.

    A bf16 ``w`` is updated in fp32 and the result rounded to bf16 stochastically with the words
    of offsets 0 .. P - 1 of the 32-bit ``seed`` (``_rounding.round_stochastic``): an EMA step of
    ``1 - beta2`` = 0.001 moves w by less than half a bf16 unit (2**-9 of it) unless the new square
    differs from w by about half, so round-to-nearest would freeze it; rounded stochastically it
    follows the fp32 EMA in expectation. An offset kept (not finite) stays bitwise."""
    g = g.float().reshape(-1)
    old = w.float()
    new = beta2 * old + (1 - beta2) * (g * g).view(-1, block).mean(dim=0)
    new = torch.where(torch.isfinite(new), new, old)
    if w.dtype == torch.float32:
        return new
    return round_stochastic(new, w.dtype, seed)


def factor_ratio(w):
    """``r_j = w_j / mean(w)`` (all ones where ``mean(w) == 0``): the per-offset scale of v, in
    fp32 (a bf16 ``w`` is read as fp32)."""
    w = w.float()
    mean = w.mean()
    return w / mean if float(mean) > 0 else torch.ones_like(w)


def gefen_step(p, g, v, scales, codes, codebook, *, step, lr, beta1, beta2, eps, weight_decay,
               block, bits, w=None, code_seed=None, scale=None, factor_seed=None, bound=None):
    """One Gefen step on one flat tensor (see the module docstring). Returns new (p, v, scales, codes),
    and the new ``w`` last when ``w`` is given.

    ``p`` and ``g`` may be any float dtype; the math and the returned ``p`` are fp32.
    ``w``: the per-offset factor of the factored second moment (P floats), or None for the
    published, unfactored rule. ``code_seed``: the 32-bit seed of this step's stochastic rounding
    of the codes (``quantize``), or None for the nearest entry. ``scale``: the length S of the scale
    blocks where it is not ``scale_block_length(block)``, a multiple of ``block``. ``factor_seed``:
    the 32-bit seed of a bf16 ``w``'s stochastic rounding (``factor_update``). ``bound``: clip m^ to
    ``bound * sqrt(own_moment_cap)`` (module doc), None or inf for none.
    """
    s_len = scale or block  # what quantize and dequantize read their scale blocks from
    p = p.float().reshape(-1)
    g = g.float().reshape(-1)
    n = p.numel()
    ratio = None
    if w is not None:
        w = factor_update(w, g, block=block, beta2=beta2, seed=factor_seed)
        ratio = factor_ratio(w)
    v = beta2 * v + (1 - beta2) * (g * g).view(-1, block).mean(dim=1)
    p = p * (1 - lr * weight_decay)
    if codebook is None:
        m = codes.lerp(g, 1 - beta1)
        codes, m_hat = m, m
    else:
        m = dequantize(scales, codes, codebook, numel=n, block=s_len, bits=bits)
        m = m.lerp(g, 1 - beta1)
        scales, codes = quantize(m, codebook, block=s_len, bits=bits, seed=code_seed)
        m_hat = dequantize(scales, codes, codebook, numel=n, block=s_len, bits=bits)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    if ratio is None:
        d = (v.sqrt() / math.sqrt(bias_correction2)).repeat_interleave(block)
    else:
        vr = (v.view(-1, 1) * ratio.view(1, -1)).reshape(-1)
        d = vr.sqrt() / math.sqrt(bias_correction2)
    if bound is not None and math.isfinite(bound):
        du = own_moment_cap(v, block=block, w=w).sqrt() / math.sqrt(bias_correction2)
        m_hat = clip_moment(m_hat, du * bound_scale(bound, math.sqrt(bias_correction2)))
    p = p.addcdiv(m_hat, d.add(eps), value=-lr / bias_correction1)
    return (p, v, scales, codes) if w is None else (p, v, scales, codes, w)


def init_state(numel: int, *, block: int, bits: int, quantized: bool = True, scale: int | None = None):
    """Fresh (v, scales, codes) of an n-element tensor: all zeros, i.e. v = 0 and m = 0 (``scale``:
    as ``gefen_step``'s)."""
    v = torch.zeros(numel // block, dtype=torch.float32)
    if not quantized:
        return v, torch.zeros(0, dtype=torch.float32), torch.zeros(numel, dtype=torch.float32)
    return (v, torch.zeros(num_scales(numel, scale or block), dtype=torch.float32),
            torch.zeros(num_code_bytes(numel, bits), dtype=torch.uint8))
