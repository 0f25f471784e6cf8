"""The Gefen step in place with torch operations: any device, many tensors at once.

``gefen_step_`` steps the tiles of one call (``plan.Tile`` records: fields p, v, scales, first, w;
``tiling``'s module docstring) on their gradients with the hyper-parameters of a ``plan.Hyper``
record (step, lr, beta1, beta2, eps, weight_decay, bound): :func:`optim.gefen.reference.gefen_step`'s
rule, for tensors that share ``block``, ``step`` and the hyper-parameters, in place. The tensors are laid
side by side as rows of one scale block each (``S = block``, or ``S = 256`` for block 1 with each
tensor zero-padded to a whole chunk), so every block reduction is one row reduction over the
whole list. The math is the reference's, operation for operation, so scales agree with it exactly
and parameters to fp32 rounding; codes are ``codebook.nearest_code``'s (the reference's, except
that of two equal entries the first is written), or with ``code_seeds`` ``codebook.stochastic_code``'s
(the reference's ``stochastic_round``, bit for bit).

The nearest entry is looked up in ``codebook.code_table``'s table (one gather and one comparison
an element) instead of a binary search over the boundaries.
"""

import math

import torch

from .._rounding import STOCHASTIC_DTYPES, random_bits, round_stochastic
from .codebook import code_table, nearest_code, stochastic_code
from .reference import bound_scale, clip_moment, factor_ratio, pack_codes, scale_block_length, unpack_codes
from .tiling import (as_rows, contiguous, element_size, factor_update_, factors, from_rows, pieces, piece_of,
                     write_back)


def refuses(param_dtype: torch.dtype, group) -> str | None:
    """The torch step takes every floating dtype and option: never a refusal."""
    return None


def data_refusal(*, block: int | None, bits: int, quant: bool, tables=None, scale: int | None = None) -> str | None:
    """The torch step takes every block length and codebook: never a refusal."""
    return None


@torch.no_grad()
def gefen_step_(tiles, gs, codebook, hyper, *, block, bits, tables=None, seeds=None, code_seeds=None, scale=None,
                factor_seeds=None):
    """In-place Gefen step on the ``tiles`` of one call, sharing ``block`` and ``hyper.step`` (see
    module doc).

    ``tiles``: ``plan.Tile`` records (p, v, scales, first, w); ``codebook`` None: the first moment
    is unquantised (``first`` fp32 m, ``scales`` None). A tile's ``w`` (fp32 or bf16, ``block``
    floats; every tile's or none) is the per-offset factor of a factored second moment, updated in
    place (see ``reference.py``). ``gs``: each tile's gradient. ``hyper``: a ``plan.Hyper``.
    ``tables``: ``code_table(codebook)``, built here when not given (pass it to avoid rebuilding
    it every step). ``seeds``: one 32-bit seed per tile for stochastic rounding of bf16 and fp16
    parameters (``optim._rounding``), or None for round-to-nearest. ``code_seeds``: one 32-bit
    seed per tile for stochastic rounding of the first moment's codes (``reference.quantize``), or
    None for the nearest entry. ``scale``: the length S of the scale blocks where it is not
    ``scale_block_length(block)``, a multiple of ``block`` (``reference.gefen_step``'s).
    ``factor_seeds``: one 32-bit seed per bf16 w (``tiling.factor_update_``). The work is done a
    piece at a time (``tiling.pieces``).
    """
    if tables is None and codebook is not None:
        tables = code_table(codebook)
    ratios = None
    ws = factors(tiles)
    if ws is not None:
        factor_update_(ws, gs, block=block, beta2=hyper.beta2, seeds=factor_seeds)
    S = scale or scale_block_length(block)
    W = S // block
    width = bits if codebook is not None else 8
    numels = [t.p.numel() for t in tiles]
    if ws is not None and block > 1:  # r == 1 exactly at block 1: nothing to scale
        # r_j, and where m^ is clipped the cap n_b w_j (reference.own_moment_cap) of the whole tile
        clipped = math.isfinite(hyper.bound)
        ratios = [(factor_ratio(w), w.float() * (n // block) if clipped else None) for w, n in zip(ws, numels)]
    work = contiguous(tiles)  # pieces are views of flat tensors
    for piece in pieces(numels, S, width, element_size([t.p for t in work])):
        part, part_g = piece_of(work, gs, piece, S=S, W=W, bits=width)
        _step_rows(part, part_g, codebook, tables, None if ratios is None else [ratios[t] for t, _ in piece],
                   None if seeds is None else [(seeds[t], r.start * S) for t, r in piece],
                   None if code_seeds is None or codebook is None else [(code_seeds[t], r.start * S)
                                                                         for t, r in piece],
                   hyper, block=block, bits=bits, S=S)
    write_back(tiles, work)


def _step_rows(tiles, gs, codebook, tables, ratios, seeds, code_seeds, hyper, *, block, bits, S):
    """The step on the tiles of one piece (flat slices) laid side by side as rows of ``S``.
    ``seeds`` and ``code_seeds``: (seed, offset of the piece's first element in its tensor) per
    tile."""
    step, lr, beta1, beta2, eps, weight_decay = (hyper.step, hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
                                                 hyper.weight_decay)
    W = S // block  # v entries per row: 1 at the default S of block > 1, 256 when block == 1
    ps, vs, codes = [t.p for t in tiles], [t.v for t in tiles], [t.first for t in tiles]
    numels = [p.numel() for p in ps]
    # float64 state (float64 parameters, AdamW's unquantised per-element moments) keeps the
    # arithmetic in float64; everything else runs in fp32.
    wdt = torch.float64 if vs and vs[0].dtype == torch.float64 else torch.float32
    X = as_rows([p.reshape(-1) for p in ps], S).to(wdt)
    G = as_rows([g.reshape(-1) for g in gs], S).to(wdt)
    R = G.shape[0]
    V = as_rows(vs, W)
    V = beta2 * V + (1 - beta2) * (G * G).view(R, W, block).mean(dim=-1)
    X = X * (1 - lr * weight_decay)
    if codebook is None:
        M = as_rows(codes, S).lerp(G, 1 - beta1)
        m_hat = M
    else:
        scales = [t.scales for t in tiles]
        idx = as_rows([unpack_codes(c, n, bits) for c, n in zip(codes, numels)], S)
        M = codebook[idx] * as_rows(scales, 1)
        if R * S != sum(numels):  # zero-padded partial chunks (block 1) must hold m = 0
            M = M * as_rows([M.new_ones(n) for n in numels], S)
        M = M.lerp(G, 1 - beta1)
        del G
        s_new = M.abs().amax(dim=1, keepdim=True)
        q = torch.where(s_new > 0, M / s_new, torch.zeros_like(M))
        if code_seeds is None:
            idx = nearest_code(q, tables)
        else:
            words = as_rows([random_bits(seed, start, n, q.device) for (seed, start), n in zip(code_seeds, numels)],
                            S)
            idx = stochastic_code(q, tables, words)
            del words
        del q
        m_hat = codebook[idx] * s_new
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    Vb = V.unsqueeze(-1)
    if ratios is not None:
        R_ = as_rows([r.repeat(n // block) for (r, _), n in zip(ratios, numels)], block).to(wdt).view(R, W, block)
        d = (Vb * R_).sqrt() / bias_correction2**0.5
    else:
        d = Vb.sqrt() / bias_correction2**0.5
    m_hat = m_hat.view(R, W, block)
    if math.isfinite(hyper.bound):  # reference.own_moment_cap, row by row
        u = Vb * block
        if ratios is not None:
            cap = as_rows([c.repeat(n // block) for (_, c), n in zip(ratios, numels)], block).to(wdt)
            u = torch.minimum(u, cap.view(R, W, block))
        m_hat = clip_moment(m_hat, u.sqrt() / bias_correction2**0.5 * bound_scale(hyper.bound, bias_correction2**0.5))
    X = X.view(R, W, block).addcdiv(m_hat, d.add(eps), value=-lr / bias_correction1).view(R, S)
    for i, (p, x) in enumerate(zip(ps, from_rows(X, numels, S))):
        if seeds is not None and p.dtype in STOCHASTIC_DTYPES:
            x = round_stochastic(x, p.dtype, *seeds[i])
        p.copy_(x.view_as(p))
    for v, x in zip(vs, from_rows(V, [v.numel() for v in vs], W)):
        v.copy_(x)
    if codebook is None:
        for c, x in zip(codes, from_rows(M, numels, S)):
            c.copy_(x)
        return
    idx8 = idx.to(torch.uint8)
    for c, x in zip(codes, from_rows(idx8, numels, S)):
        c.copy_(pack_codes(x, bits))
    for s, x in zip(scales, from_rows(s_new, [s.numel() for s in scales], 1)):
        s.copy_(x)
