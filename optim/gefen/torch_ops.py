"""The Gefen step in place with torch operations: any device, many tensors at once.

``gefen_step_`` takes :func:`optim.gefen.reference.gefen_step`'s keywords, but lists of tensors
that share ``block``, ``step`` and the hyperparameters, and updates them in place. The tensors are
laid side by side as rows of one scale block each (``S = block``, or ``S = 256`` for block 1 with
each tensor zero-padded to a whole chunk), so every block reduction is one row reduction over the
whole list. The math is the reference's, operation for operation, so scales agree with it exactly
and parameters to fp32 rounding; codes are ``codebook.nearest_code``'s (the reference's, except
that of two equal entries the first is written), or with ``code_seeds`` ``codebook.stochastic_code``'s
(the reference's ``stochastic_round``, bit for bit).

The nearest entry is looked up in ``codebook.code_table``'s table (one gather and one comparison
an element) instead of a binary search over the boundaries.
"""

import math
from typing import NamedTuple

import torch

from .._rounding import STOCHASTIC_DTYPES, random_bits, round_stochastic
from .codebook import HIST_BINS, code_table, histogram as _histogram, nearest_code, stochastic_code
from .reference import (dequantize, factor_ratio, num_code_bytes, num_scales, pack_codes, quantize,
                        scale_block_length, unpack_codes)


def refuses(param_dtype: torch.dtype, group) -> str | None:
    """The torch step takes every floating dtype and option: never a refusal."""
    return None


def data_refusal(*, block: int | None, bits: int, quant: bool, tables=None, scale: int | None = None) -> str | None:
    """The torch step takes every block length and codebook: never a refusal."""
    return None


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


PIECE_ELEMENTS = 1 << 16  # most elements one piece of the step works on (see ``pieces``)


class Piece(NamedTuple):
    """Rows ``rows`` (of ``S`` elements) of tensor ``t`` of a call, taken as one tensor."""

    t: int
    rows: range


def pieces(numels, S: int, bits: int, element_size: int = 4, limit: int = PIECE_ELEMENTS, temp_bytes: int = 128):
    """The call's tensors cut into lists of ``Piece`` of at most about ``limit`` elements each.

    Whole small tensors are packed together (one row reduction serves many tensors); a tensor
    of more rows is cut into row ranges, so the step's temporaries (about 50 bytes an element,
    about 80 with stochastic codes) stay about ``limit`` elements long however large the tensor. On
    small models ``limit`` shrinks to the largest tensor's bytes (``element_size`` bytes an element)
    / ``temp_bytes`` (the temporaries an element of a piece costs, with room to spare: 128 for this
    step, stochastic rounding's of weights and codes included), so they stay under that tensor's
    bytes. With 4-bit codes and odd ``S`` a cut falls on an even row (two codes share a byte).
    """
    limit = piece_limit(numels, S, element_size, limit, temp_bytes)
    step = max(1, limit // S)
    if bits == 4 and S % 2 and step % 2:
        step += 1
    out, cur, size = [], [], 0
    for t, n in enumerate(numels):
        rows = -(-n // S)
        if rows <= step:
            if size + rows > step and cur:
                out.append(cur)
                cur, size = [], 0
            cur.append(Piece(t, range(rows)))
            size += rows
            continue
        for a in range(0, rows, step):
            out.append([Piece(t, range(a, min(a + step, rows)))])
    if cur:
        out.append(cur)
    return out


def piece_limit(numels, width: int, element_size: int = 4, limit: int = PIECE_ELEMENTS,
                temp_bytes: int = 128) -> int:
    """Elements of one piece (at least ``width``): ``limit``, or the largest tensor's bytes /
    ``temp_bytes``."""
    return max(width, min(limit, max(numels, default=0) * element_size // temp_bytes))


def contiguous(ps) -> list:
    """Each tensor, or a contiguous copy of it where it is not (written back by ``write_back``)."""
    return [p if p.is_contiguous() else p.contiguous() for p in ps]


def write_back(targets, copies):
    """Copy each contiguous copy of ``contiguous`` back into its (strided) tensor."""
    for p, c in zip(targets, copies):
        if c is not p:
            p.copy_(c)


def _element_size(ts) -> int:
    """Bytes an element of the tensors of a call (the smallest, for a mixed call)."""
    return min((t.element_size() for t in ts), default=4)


def slice_rows(x: torch.Tensor, rows: range, width: int, numel: int | None = None) -> torch.Tensor:
    """Elements ``rows.start * width .. rows.stop * width`` of flat ``x`` (clipped to ``numel``)."""
    end = rows.stop * width if numel is None else min(rows.stop * width, numel)
    return x.reshape(-1)[rows.start * width:end]


def code_slice(c: torch.Tensor, rows: range, S: int, numel: int, bits: int) -> torch.Tensor:
    """The codes (or unquantised m) of elements of ``rows``; at 4 bits two a byte (even start)."""
    a, b = rows.start * S, min(rows.stop * S, numel)
    return c[a // 2:(b + 1) // 2] if bits == 4 else c[a:b]


@torch.no_grad()
def factor_update_(ws, gs, *, block, beta2, seeds=None):
    """``reference.factor_update`` in place on each (w, g): the factored steps' first pass, over
    pieces of ``PIECE_ELEMENTS`` (whole blocks) of each gradient. ``seeds``: one 32-bit seed per
    bf16 w, which is stored rounded stochastically (None where every w is fp32)."""
    limit = piece_limit([g.numel() for g in gs], block, _element_size(gs))
    for k, (w, g) in enumerate(zip(ws, gs)):
        flat = g.detach().reshape(-1)
        rows = flat.numel() // block
        step = max(1, limit // block)
        total = torch.zeros(block, dtype=torch.float32, device=w.device)
        for a in range(0, rows, step):
            part = flat[a * block:min(a + step, rows) * block].float()
            total += (part * part).view(-1, block).sum(dim=0)
        old = w.float()
        new = beta2 * old + (1 - beta2) * (total / rows)
        new = torch.where(torch.isfinite(new), new, old)  # a non-finite offset keeps its value
        w.copy_(new if w.dtype == torch.float32 else round_stochastic(new, w.dtype, seeds[k]))


@torch.no_grad()
def gefen_step_(ps, gs, vs, scales, codes, codebook, *, step, lr, beta1, beta2, eps,
                weight_decay, block, bits, tables=None, ws=None, seeds=None, code_seeds=None, scale=None,
                factor_seeds=None):
    """In-place Gefen step on lists of tensors sharing ``block`` and ``step`` (see module doc).

    ``tables``: ``code_table(codebook)``, built here when not given (pass it to avoid rebuilding
    it every step). ``ws``: the per-offset factors of a factored second moment (fp32, ``block``
    floats each), updated in place, or None (see ``reference.py``). ``seeds``: one 32-bit seed
    per tensor for stochastic rounding of bf16 and fp16 parameters (``optim._rounding``), or
    None for round-to-nearest. ``code_seeds``: one 32-bit seed per tensor for stochastic rounding
    of the first moment's codes (``reference.quantize``), or None for the nearest entry. ``scale``:
    the length S of the scale blocks where it is not ``scale_block_length(block)``, a multiple of
    ``block`` (``reference.gefen_step``'s). ``factor_seeds``: one 32-bit seed per bf16 w
    (``factor_update_``). The work is done a piece at a time (``pieces``).
    """
    if tables is None and codebook is not None:
        tables = code_table(codebook)
    ratios = None
    if ws is not None:
        factor_update_(ws, gs, block=block, beta2=beta2, seeds=factor_seeds)
        if block > 1:  # r == 1 exactly at block 1: nothing to scale
            ratios = [factor_ratio(w) for w in ws]
    S = scale or scale_block_length(block)
    W = S // block
    numels = [p.numel() for p in ps]
    targets, ps = ps, contiguous(ps)  # pieces are views of flat tensors
    for piece in pieces(numels, S, bits if codebook is not None else 8, _element_size(ps)):
        sel = [(t, rows, numels[t]) for t, rows in piece]
        _step_rows(
            [slice_rows(ps[t], r, S, n) for t, r, n in sel], [slice_rows(gs[t], r, S, n) for t, r, n in sel],
            [slice_rows(vs[t], r, W) for t, r, _ in sel],
            [slice_rows(scales[t], r, 1) for t, r, _ in sel] if codebook is not None else None,
            [code_slice(codes[t], r, S, n, bits if codebook is not None else 8) for t, r, n in sel],
            codebook, tables, None if ratios is None else [ratios[t] for t, _, _ in sel],
            None if seeds is None else [(seeds[t], r.start * S) for t, r, _ in sel],
            None if code_seeds is None or codebook is None else [(code_seeds[t], r.start * S) for t, r, _ in sel],
            step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            block=block, bits=bits, S=S)
    write_back(targets, ps)


def _step_rows(ps, gs, vs, scales, codes, codebook, tables, ratios, seeds, code_seeds, *, step, lr, beta1,
               beta2, eps, weight_decay, block, bits, S):
    """The step on a list of flat tensors laid side by side as rows of ``S`` (one piece). ``seeds``
    and ``code_seeds``: (seed, offset of the piece's first element in its tensor) per tensor."""
    W = S // block  # v entries per row: 1 at the default S of block > 1, 256 when block == 1
    numels = [p.numel() for p in ps]
    # float64 state (float64 parameters, AdamW's unquantised per-element moments) keeps the
    # arithmetic in float64; everything else runs in fp32.
    wdt = torch.float64 if vs and vs[0].dtype == torch.float64 else torch.float32
    X = _rows([p.reshape(-1) for p in ps], S).to(wdt)
    G = _rows([g.reshape(-1) for g in gs], S).to(wdt)
    R = G.shape[0]
    V = _rows(vs, W)
    V = beta2 * V + (1 - beta2) * (G * G).view(R, W, block).mean(dim=-1)
    X = X * (1 - lr * weight_decay)
    if codebook is None:
        M = _rows(codes, S).lerp(G, 1 - beta1)
        m_hat = M
    else:
        idx = _rows([unpack_codes(c, n, bits) for c, n in zip(codes, numels)], S)
        M = codebook[idx] * _rows(scales, 1)
        if R * S != sum(numels):  # zero-padded partial chunks (block 1) must hold m = 0
            M = M * _rows([M.new_ones(n) for n in numels], S)
        M = M.lerp(G, 1 - beta1)
        del G
        s_new = M.abs().amax(dim=1, keepdim=True)
        q = torch.where(s_new > 0, M / s_new, torch.zeros_like(M))
        if code_seeds is None:
            idx = nearest_code(q, tables)
        else:
            words = _rows([random_bits(seed, start, n, q.device) for (seed, start), n in zip(code_seeds, numels)], S)
            idx = stochastic_code(q, tables, words)
            del words
        del q
        m_hat = codebook[idx] * s_new
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    if ratios is not None:
        R_ = _rows([r.repeat(n // block) for r, n in zip(ratios, numels)], block).to(wdt)
        denom = ((V.unsqueeze(-1) * R_.view(R, W, block)).sqrt() / bias_correction2**0.5).add(eps)
    else:
        denom = (V.sqrt() / bias_correction2**0.5).add(eps).unsqueeze(-1)
    X = X.view(R, W, block).addcdiv(m_hat.view(R, W, block), denom,
                                    value=-lr / bias_correction1).view(R, S)
    for i, (p, x) in enumerate(zip(ps, _unrows(X, numels, S))):
        if seeds is not None and p.dtype in STOCHASTIC_DTYPES:
            x = round_stochastic(x, p.dtype, *seeds[i])
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
def requantize_(st: dict, codebook, *, n: int, old: int, new: int, bits: int):
    """Re-encode the first moment of state ``st`` (``scales``, ``codes`` of an n-element tensor)
    from the scale blocks of block length ``old`` into those of ``new``, a piece at a time:
    ``m = C[code] * s`` decoded, then quantised as the step quantises it."""
    s_old, s_new = scale_block_length(old), scale_block_length(new)
    unit = math.lcm(s_old, s_new, 2)
    length = unit * max(1, PIECE_ELEMENTS // unit)
    scales = st["scales"].new_zeros(num_scales(n, new))
    codes = st["codes"].new_zeros(num_code_bytes(n, bits))
    if codebook is not None:
        cb = codebook.to(scales.device)
        for a in range(0, n, length):
            b = min(a + length, n)
            rows = range(a, b)  # a is even: no code byte is shared with the previous piece
            m = dequantize(st["scales"][a // s_old:-(-b // s_old)], code_slice(st["codes"], rows, 1, n, bits),
                           cb, numel=b - a, block=old, bits=bits)
            sc, cd = quantize(m, cb, block=new, bits=bits)
            scales[a // s_new:a // s_new + sc.numel()] = sc
            code_slice(codes, rows, 1, n, bits).copy_(cd)
    st["scales"], st["codes"] = scales, codes


@torch.no_grad()
def remap_codes_(codes: torch.Tensor, table: torch.Tensor) -> None:
    """Replace each stored code byte c of ``codes`` by ``table[c]`` (``codebook.code_map``), in
    place, a piece at a time (the index is int64)."""
    flat = codes.view(-1)
    table = table.to(codes.device)
    for a in range(0, flat.numel(), PIECE_ELEMENTS):
        part = flat[a:a + PIECE_ELEMENTS]
        part.copy_(table[part.long()])


@torch.no_grad()
def histogram(gs, *, block: int, bins: int = HIST_BINS) -> torch.Tensor:
    """Counts (int64, ``bins``) of gradients divided by their scale block's absmax, on [-1, 1].

    Binned by ``codebook.histogram`` (upstream's rule); an all-zero block counts as zeros. Counted
    a piece at a time (``pieces``), so the temporaries do not grow with the model.
    """
    S = scale_block_length(block)
    numels = [g.numel() for g in gs]
    counts = torch.zeros(bins, dtype=torch.int64)
    for piece in pieces(numels, S, 8, _element_size(gs)):
        part = [slice_rows(gs[t], rows, S, numels[t]) for t, rows in piece]
        G = _rows([g.reshape(-1).float() for g in part], S)
        s = G.abs().amax(dim=1, keepdim=True)
        q = torch.where(s > 0, G / s, torch.zeros_like(G))
        del G
        counts += _histogram(_unrows(q, [g.numel() for g in part], S), bins=bins)[1]
    return counts
