"""The Gefen step in place with torch operations: any device, many tensors at once.

``gefen_step_`` takes :func:`optim.gefen.reference.gefen_step`'s keywords, but lists of tensors
that share ``block``, ``step`` and the hyperparameters, and updates them in place. The tensors are
laid side by side as rows of one scale block each (``S = block``, or ``S = 256`` for block 1 with
each tensor zero-padded to a whole chunk), so every block reduction is one row reduction over the
whole list. The math is the reference's, operation for operation, so scales agree with it exactly
and parameters to fp32 rounding; codes are ``codebook.nearest_code``'s (the reference's, except
that of two equal entries the first is written).

The nearest entry is looked up in ``codebook.code_table``'s table (one gather and one comparison
an element) instead of a binary search over the boundaries.
"""

import torch

from .codebook import HIST_BINS, code_table, histogram as _histogram, nearest_code
from .reference import factor_ratio, pack_codes, scale_block_length, unpack_codes


def _rows(flats, width: int) -> torch.Tensor:
    """Concatenate 1-D tensors, each zero-padded to a multiple of ``width``, as (rows, width)."""
    parts = []
    for x in flats:
        pad = (-x.numel()) % width
        parts.append(torch.nn.functional.pad(x, (0, pad)) if pad else x)
    return torch.cat(parts).view(-1, width) if len(parts) > 1 else parts[0].view(-1, width)


def _unrows(x: torch.Tensor, numels, width: int):
    """Inverse of :func:`_rows`: per-tensor 1-D views of the unpadded elements."""
    out, r = [], 0
    for n in numels:
        rows = -(-n // width)
        out.append(x[r:r + rows].reshape(-1)[:n])
        r += rows
    return out


@torch.no_grad()
def factor_update_(ws, gs, *, block, beta2):
    """``reference.factor_update`` in place on each (w, g): the factored steps' first pass."""
    for w, g in zip(ws, gs):
        gf = g.detach().reshape(-1).float()
        new = beta2 * w + (1 - beta2) * (gf * gf).view(-1, block).mean(dim=0)
        w.copy_(torch.where(torch.isfinite(new), new, w))  # a non-finite offset keeps its value


def _ratio_rows(ws, numels, block: int) -> torch.Tensor:
    """``factor_ratio(w)`` of each tensor repeated over its blocks, as ``_rows(.., block)``."""
    return _rows([factor_ratio(w).repeat(n // block) for w, n in zip(ws, numels)], block)


@torch.no_grad()
def gefen_step_(ps, gs, vs, scales, codes, codebook, *, step, lr, beta1, beta2, eps,
                weight_decay, block, bits, tables=None, ws=None):
    """In-place Gefen step on lists of tensors sharing ``block`` and ``step`` (see module doc).

    ``tables``: ``code_table(codebook)``, built here when not given (pass it to avoid rebuilding
    it every step). ``ws``: the per-offset factors of a factored second moment (fp32, ``block``
    floats each), updated in place, or None (see ``reference.py``).
    """
    S = scale_block_length(block)
    W = S // block  # v entries per row: 1 when block > 1, 256 when block == 1
    numels = [p.numel() for p in ps]
    # float64 state (float64 parameters, AdamW's unquantised per-element moments) keeps the
    # arithmetic in float64; everything else runs in fp32.
    wdt = torch.float64 if vs and vs[0].dtype == torch.float64 else torch.float32
    X = _rows([p.reshape(-1) for p in ps], S).to(wdt)
    G = _rows([g.reshape(-1) for g in gs], S).to(wdt)
    R = G.shape[0]
    if ws is not None:
        factor_update_(ws, gs, block=block, beta2=beta2)
    V = _rows(vs, W)
    V = beta2 * V + (1 - beta2) * (G * G).view(R, W, block).mean(dim=-1)
    X = X * (1 - lr * weight_decay)
    if codebook is None:
        M = _rows(codes, S).lerp(G, 1 - beta1)
        m_hat = M
    else:
        if tables is None:
            tables = code_table(codebook)
        idx = _rows([unpack_codes(c, n, bits) for c, n in zip(codes, numels)], S)
        M = codebook[idx] * _rows(scales, 1)
        if R * S != sum(numels):  # zero-padded partial chunks (block 1) must hold m = 0
            M = M * _rows([M.new_ones(n) for n in numels], S)
        M = M.lerp(G, 1 - beta1)
        s_new = M.abs().amax(dim=1, keepdim=True)
        q = torch.where(s_new > 0, M / s_new, torch.zeros_like(M))
        idx = nearest_code(q, tables)
        m_hat = codebook[idx] * s_new
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    if ws is not None and block > 1:  # r == 1 exactly at block 1: nothing to scale
        denom = ((V * _ratio_rows(ws, numels, block).to(wdt)).sqrt() / bias_correction2**0.5).add(eps)
        denom = denom.view(R, W, block)
    else:
        denom = (V.sqrt() / bias_correction2**0.5).add(eps).unsqueeze(-1)
    X = X.view(R, W, block).addcdiv(m_hat.view(R, W, block), denom,
                                    value=-lr / bias_correction1).view(R, S)
    for p, x in zip(ps, _unrows(X, numels, S)):
        p.copy_(x.view_as(p))
    for v, x in zip(vs, _unrows(V, [v.numel() for v in vs], W)):
        v.copy_(x)
    if codebook is None:
        for c, x in zip(codes, _unrows(M, numels, S)):
            c.copy_(x)
        return
    idx8 = idx.to(torch.uint8)
    for c, x in zip(codes, _unrows(idx8, numels, S)):
        c.copy_(pack_codes(x, bits))
    for s, x in zip(scales, _unrows(s_new, [s.numel() for s in scales], 1)):
        s.copy_(x)


@torch.no_grad()
def histogram(gs, *, block: int, bins: int = HIST_BINS) -> torch.Tensor:
    """Counts (int64, ``bins``) of gradients divided by their scale block's absmax, on [-1, 1].

    Binned by ``codebook.histogram`` (upstream's rule); an all-zero block counts as zeros.
    """
    S = scale_block_length(block)
    numels = [g.numel() for g in gs]
    G = _rows([g.reshape(-1).float() for g in gs], S)
    s = G.abs().amax(dim=1, keepdim=True)
    q = torch.where(s > 0, G / s, torch.zeros_like(G))
    return _histogram(_unrows(q, numels, S), bins=bins)[1]
