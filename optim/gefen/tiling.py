"""Gefen's tiling and the math its three step backends share (torch, numba, Triton).

A backend steps a call's tiles: records with the fields ``p`` (a parameter, or a tile of its rows),
``v``, ``scales`` (None when the first moment is unquantised), ``first`` (uint8 codes, or the fp32
first moment m when unquantised) and ``w`` (the factor of a factored second moment, else None);
``plan.Tile`` is that record. ``factors`` reads the call's w.

The work of a step or of a state-wide pass is cut into pieces (``pieces``) of whole scale blocks
of ``S`` elements, so its temporaries stay about ``PIECE_ELEMENTS`` long however large a tensor;
``piece_of`` slices a call's tiles and gradients to a piece, ``contiguous`` / ``write_back`` give
the flat working copies the slices are views of. The torch step lays a piece's tensors side by side
as rows of ``S`` (``as_rows`` / ``from_rows``), so every block reduction is one row reduction.
``factor_update_`` is the factored steps' first pass (torch and numba). ``histogram``,
``requantize_`` and ``remap_codes_`` are the optimizer's state-wide passes, a piece at a time.
"""

import math
from typing import NamedTuple

import torch

from .._rounding import round_stochastic
from .codebook import HIST_BINS, histogram as _histogram
from .reference import dequantize, num_code_bytes, num_scales, quantize, scale_block_length

PIECE_ELEMENTS = 1 << 16  # most elements one piece of the step works on (see ``pieces``)


def factors(tiles) -> list | None:
    """Each tile's factor w, or None where no tile holds one (the call is not factored)."""
    ws = [t.w for t in tiles]
    if all(w is None for w in ws):
        return None
    if any(w is None for w in ws):
        k = ws.index(None)
        raise ValueError(f"Gefen kernel: tile {k} holds no factor w, tile {1 - bool(k)} does; the tiles of "
                         "one call are all factored or none is")
    return ws


# ------------------------------------------------------------------------------ pieces
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
    / ``temp_bytes`` (the temporaries an element of a piece costs, with room to spare: 128 for the
    torch step, stochastic rounding's of weights and codes included), so they stay under that
    tensor's bytes. With 4-bit codes and odd ``S`` a cut falls on an even row (two codes share a byte).
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


def element_size(ts) -> int:
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


def piece_of(tiles, gs, piece, *, S: int, W: int, bits: int) -> tuple:
    """(tiles, gradients) of one ``pieces`` list: each tile's p, v, scales and first, and its
    gradient, sliced to the piece's rows of ``S`` elements (``W`` v entries a row; ``bits``: 8 for
    an unquantised first moment, one value an element); w stays whole."""
    out, grads = [], []
    for t, rows in piece:
        x, n = tiles[t], tiles[t].p.numel()
        out.append(x._replace(p=slice_rows(x.p, rows, S, n), v=slice_rows(x.v, rows, W),
                              scales=None if x.scales is None else slice_rows(x.scales, rows, 1),
                              first=code_slice(x.first, rows, S, n, bits)))
        grads.append(slice_rows(gs[t], rows, S, n))
    return out, grads


def contiguous(tiles) -> list:
    """Each tile, or where its p is not contiguous the tile with a contiguous copy of p (written
    back by ``write_back``)."""
    return [t if t.p.is_contiguous() else t._replace(p=t.p.contiguous()) for t in tiles]


def write_back(tiles, copies) -> None:
    """Copy each contiguous copy of ``contiguous`` back into its tile's (strided) p."""
    for t, c in zip(tiles, copies):
        if c.p is not t.p:
            t.p.copy_(c.p)


# ------------------------------------------------------------------------------ row layout
def as_rows(flats, width: int) -> torch.Tensor:
    """Concatenate 1-D tensors, each zero-padded to a multiple of ``width``, as (rows, width)."""
    parts = []
    for x in flats:
        pad = (-x.numel()) % width
        parts.append(torch.nn.functional.pad(x, (0, pad)) if pad else x)
    return torch.cat(parts).view(-1, width) if len(parts) > 1 else parts[0].view(-1, width)


def from_rows(x: torch.Tensor, numels, width: int):
    """Inverse of :func:`as_rows`: per-tensor 1-D views of the unpadded elements."""
    out, r = [], 0
    for n in numels:
        rows = -(-n // width)
        out.append(x[r:r + rows].reshape(-1)[:n])
        r += rows
    return out


# ------------------------------------------------------------------------------ shared math
@torch.no_grad()
def factor_update_(ws, gs, *, block, beta2, seeds=None):
    """``reference.factor_update`` in place on each (w, g): the factored steps' first pass, over
    pieces of ``PIECE_ELEMENTS`` (whole blocks) of each gradient. ``seeds``: one 32-bit seed per
    bf16 w, which is stored rounded stochastically (None where every w is fp32)."""
    limit = piece_limit([g.numel() for g in gs], block, element_size(gs))
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


# ------------------------------------------------------------------------------ state-wide passes
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
    for piece in pieces(numels, S, 8, element_size(gs)):
        part = [slice_rows(gs[t], rows, S, numels[t]) for t, rows in piece]
        G = as_rows([g.reshape(-1).float() for g in part], S)
        s = G.abs().amax(dim=1, keepdim=True)
        q = torch.where(s > 0, G / s, torch.zeros_like(G))
        del G
        counts += _histogram(from_rows(q, [g.numel() for g in part], S), bins=bins)[1]
    return counts
