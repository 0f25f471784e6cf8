"""Vectorised torch fast path of the Gefen step: many tensors at once, no Python loop per block.

``gefen_step_`` takes :func:`optim.gefen.reference.gefen_step`'s keywords, but lists of tensors
that share ``block``, ``step`` and the hyperparameters, and updates them in place. The tensors are
laid side by side as rows of one scale block each (``S = block``, or ``S = 256`` for block 1 with
each tensor zero-padded to a whole chunk), so every block reduction is one row reduction over the
whole list. The math is the reference's, operation for operation, so codes and scales agree with
it exactly and parameters to fp32 rounding.

Nearest codebook entry: ``codebook.nearest_code`` with a ``CodeTable`` built once per codebook
(a lookup table over uniform bins of [-1, 1] plus one comparison with the next decision
boundary); ``torch.bucketize`` against the 255 midpoints costs ~30 ns/element on this CPU, ten
times a gather (measured for issue 4).
"""

import os

import numpy as np
import torch

from .._threads import numba_threads
from .codebook import code_table, histogram as _histogram, nearest_code
from .reference import pack_codes, scale_block_length, unpack_codes

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
def gefen_step_(ps, gs, vs, scales, codes, codebook, *, step, lr, beta1, beta2, eps,
                weight_decay, block, bits, tables=None):
    """In-place Gefen step on lists of tensors sharing ``block`` and ``step`` (see module doc)."""
    S = scale_block_length(block)
    W = S // block  # v entries per row: 1 when block > 1, 256 when block == 1
    numels = [p.numel() for p in ps]
    X = _rows([p.reshape(-1) for p in ps], S).float()
    G = _rows([g.reshape(-1) for g in gs], S).float()
    R = G.shape[0]
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
    denom = (V.sqrt() / bias_correction2**0.5).add(eps)
    X = X.view(R, W, block).addcdiv(m_hat.view(R, W, block), denom.unsqueeze(-1),
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
def histogram(gs, *, block: int, bins: int = 4096) -> torch.Tensor:
    """Counts (int64, ``bins``) of gradients divided by their scale block's absmax, on [-1, 1].

    Binned by ``codebook.histogram`` (upstream's rule); an all-zero block counts as zeros.
    """
    S = scale_block_length(block)
    numels = [g.numel() for g in gs]
    G = _rows([g.reshape(-1).float() for g in gs], S)
    s = G.abs().amax(dim=1, keepdim=True)
    q = torch.where(s > 0, G / s, torch.zeros_like(G))
    return _histogram(_unrows(q, numels, S), bins=bins)[1]


def numba_available() -> bool:
    """True when the compiled CPU step can run (numba installed, GEFEN_NUMBA != "0")."""
    if os.environ.get("GEFEN_NUMBA", "1") == "0":
        return False
    try:
        from . import _cpu_numba  # noqa: F401
    except ImportError:
        return False
    return True


_JOBS = {}
_JOB_ELEMENTS = 1 << 15  # elements per parallel job (whole scale blocks)


def _jobs(numels: tuple, S: int, bits: int) -> np.ndarray:
    """(tensor, first scale block, end scale block) rows: runs of whole blocks of ~32 K elements.

    With 4-bit codes and an odd ``S`` a run starts at an even block (an even element), so two
    runs never share a code byte. Cached per layout.
    """
    key = (numels, S, bits)
    if key not in _JOBS:
        per = max(1, _JOB_ELEMENTS // S)
        if bits == 4 and S % 2 and per % 2:
            per += 1
        rows = []
        for t, n in enumerate(numels):
            nb = -(-n // S)
            rows.extend((t, j, min(j + per, nb)) for j in range(0, nb, per))
        if len(_JOBS) > 256:
            _JOBS.clear()
        _JOBS[key] = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    return _JOBS[key]


@torch.no_grad()
def gefen_step_compiled_(ps, gs, vs, scales, codes, codebook, *, step, lr, beta1, beta2, eps,
                         weight_decay, block, bits, tables=None):
    """:func:`gefen_step_` for CPU tensors and a quantised first moment, compiled with numba.

    One kernel call for the whole list, runs of scale blocks in parallel on
    ``torch.get_num_threads()`` numba threads (the same results at any thread count); non-fp32
    or non-contiguous parameters and gradients are copied to fp32 (and parameters back).
    """
    from ._cpu_numba import kernel

    if tables is None:
        tables = code_table(codebook)
    if tables.lut is None:  # a codebook whose boundaries no lookup table separates
        return gefen_step_(ps, gs, vs, scales, codes, codebook, step=step, lr=lr, beta1=beta1,
                           beta2=beta2, eps=eps, weight_decay=weight_decay, block=block,
                           bits=bits, tables=tables)
    f32 = np.float32
    luts = _luts(tables)
    S = scale_block_length(block)
    hyper = (f32(1 - beta1), f32(beta2), f32(1 - beta2), f32(1 - lr * weight_decay),
             f32(-lr / (1 - beta1**step)), f32((1 - beta2**step) ** 0.5), f32(eps))
    rows, keep, back = [], [], []  # kernel table; fp32 working copies alive until it returns
    f32_ = torch.float32
    for p, g, v, s, c in zip(ps, gs, vs, scales, codes):
        if not (v.is_contiguous() and s.is_contiguous() and c.is_contiguous()):
            raise ValueError("Gefen state tensors must be contiguous")
        pw, gw = p, g
        if not (p.dtype == f32_ and p.is_contiguous()):
            pw = p.detach().float().contiguous()
            back.append((p, pw))
            keep.append(pw)
        if not (g.dtype == f32_ and g.is_contiguous()):
            gw = g.detach().float().contiguous()
            keep.append(gw)
        n = p.numel()
        rows.append((pw.data_ptr(), gw.data_ptr(), v.data_ptr(), s.data_ptr(), c.data_ptr(),
                     n, v.numel(), s.numel(), c.numel()))
    meta = np.array(rows, dtype=np.int64)
    jobs = _jobs(tuple(r[5] for r in rows), S, bits)
    step_fn = kernel(bits, block == 1, parallel=numba_threads() > 1)
    step_fn(meta, jobs, *luts, f32(tables.scale), block, S, *hyper)
    for p, pw in back:
        p.copy_(pw.view_as(p))


_LUTS = {}


def _luts(tables):
    """The kernel's codebook arrays for one ``CodeTable`` (cached by identity while it lives)."""
    key = id(tables)
    hit = _LUTS.get(key)
    if hit is not None and hit[0] is tables:
        return hit[1]
    cb = tables.codebook.numpy()
    lut = tables.lut.numpy()
    cb_next = np.append(cb, cb[-1])
    out = (cb, tables.boundaries.numpy(), lut.astype(np.int32), tables.boundaries.numpy()[lut],
           np.stack([cb_next[lut], cb_next[lut + 1]], axis=1).reshape(-1).copy())
    if len(_LUTS) > 64:
        _LUTS.clear()
    _LUTS[key] = (tables, out)
    return out
