"""The Gefen step in place on CPU tensors, compiled with numba: one kernel call per group.

``gefen_step_`` has the signature of :func:`optim.gefen.torch_ops.gefen_step_` and updates the same
state the same way (codes exactly, parameters and v to a few fp32 ulps; see ``_numba_kernels.py``
for the arithmetic). The kernel is fused per scale block and serves a quantised first moment whose
codebook the lookup table separates with one comparison a value (``CodeTable.ncmp <= 1``, no
repeated entries: every codebook ``optimal_codebook`` learns from a 4096-bin histogram with enough
occupied bins). Everything else (``codebook=None``, the AdamW-like unquantised first moment;
repeated or denser entries) is handed to ``torch_ops.gefen_step_``, which computes the same step.

Importing this module does not import numba; the first call does (and compiles the kernels once,
cached on disk).
"""

import numpy as np
import torch

from .._threads import numba_threads
from . import torch_ops
from .checks import check_factors, check_launch
from .codebook import code_table
from .reference import scale_block_length

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


def _meta(ps, gs, vs, scales, codes):
    """The kernel's address table and the fp32 working copies it points into.

    Returns (meta int64 (tensors, 9), keep: copies alive until the kernel returns, back: (p, copy)
    pairs to copy back). Non-fp32 or non-contiguous parameters and gradients are copied to fp32.
    """
    rows, keep, back = [], [], []
    for p, g, v, s, c in zip(ps, gs, vs, scales, codes):
        pw, gw = p, g
        if not (p.dtype == torch.float32 and p.is_contiguous()):
            pw = p.detach().float().contiguous()
            back.append((p, pw))
            keep.append(pw)
        if not (g.dtype == torch.float32 and g.is_contiguous()):
            gw = g.detach().float().contiguous()
            keep.append(gw)
        rows.append((pw.data_ptr(), gw.data_ptr(), v.data_ptr(), s.data_ptr(), c.data_ptr(),
                     p.numel(), v.numel(), s.numel(), c.numel()))
    return np.array(rows, dtype=np.int64).reshape(-1, 9), keep, back


@torch.no_grad()
def gefen_step_(ps, gs, vs, scales, codes, codebook, *, step, lr, beta1, beta2, eps,
                weight_decay, block, bits, tables=None, ws=None):
    """:func:`optim.gefen.torch_ops.gefen_step_` compiled for CPU tensors (see module doc).

    One kernel call for the whole list, runs of scale blocks in parallel on
    ``torch.get_num_threads()`` numba threads (the same results at any thread count). A factored
    second moment (``ws``) adds one pass over the gradients before it (``factor_kernel``).
    """
    if codebook is not None and tables is None:
        tables = code_table(codebook)
    if codebook is None or tables.ncmp > 1 or tables.has_repeats:
        return torch_ops.gefen_step_(ps, gs, vs, scales, codes, codebook, step=step, lr=lr,
                                     beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                     block=block, bits=bits, tables=tables, ws=ws)
    from ._numba_kernels import factor_kernel, kernel

    f32 = np.float32
    S = scale_block_length(block)
    hyper = (f32(1 - beta1), f32(beta2), f32(1 - beta2), f32(1 - lr * weight_decay),
             f32(-lr / (1 - beta1**step)), f32((1 - beta2**step) ** 0.5), f32(eps))
    check_launch(ps, gs, vs, scales, codes, block=block, bits=bits, quant=True)
    meta, keep, back = _meta(ps, gs, vs, scales, codes)
    jobs = _jobs(tuple(meta[:, 5].tolist()), S, bits)
    parallel = numba_threads() > 1
    ratio = _NO_RATIO
    if ws is not None:
        check_factors(ps, ws, block=block)
        wptrs = np.array([w.data_ptr() for w in ws], dtype=np.int64)
        partial = np.empty((jobs.shape[0], block), dtype=np.float32)
        ratio = np.empty((len(ws), block), dtype=np.float32)
        factor_kernel(parallel)(meta, jobs, wptrs, block, S, f32(beta2), f32(1 - beta2), partial, ratio)
    step_fn = kernel(bits, block == 1, parallel=parallel, factored=ws is not None)
    step_fn(meta, jobs, ratio, *_luts(tables), f32(tables.scale), block, S, *hyper)
    del keep
    for p, pw in back:
        p.copy_(pw.view_as(p))


_LUTS = {}
_NO_RATIO = np.ones((1, 1), dtype=np.float32)


def _luts(tables):
    """The kernel's arrays of one ``CodeTable`` (cached by identity while it lives): codebook,
    boundaries, table, the boundary each table bin compares with, and the two values it selects."""
    key = id(tables)
    hit = _LUTS.get(key)
    if hit is not None and hit[0] is tables:
        return hit[1]
    cb = tables.uniq.cpu().numpy()
    lut = tables.lut.cpu().numpy()
    cb_next = np.append(cb, cb[-1])
    out = (cb, tables.boundaries.cpu().numpy(), lut.astype(np.int32), tables.lut_bound.cpu().numpy(),
           np.stack([cb_next[lut], cb_next[lut + 1]], axis=1).reshape(-1).copy())
    if len(_LUTS) > 64:
        _LUTS.clear()
    _LUTS[key] = (tables, out)
    return out
