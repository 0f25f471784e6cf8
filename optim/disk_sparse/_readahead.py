"""``posix_fadvise`` over many page runs in one call that holds no GIL (numba), with a Python fallback.

A background thread that issued the reads of an announced batch one ``os.posix_fadvise`` at a time
would take the GIL back after every call, and so wait for the training loop's Python between calls:
the reads would trickle out. Compiled, the loop never touches the GIL.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_fadvise = _libc.posix_fadvise
_fadvise.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)
_fadvise.restype = ctypes.c_int
_compiled = None


def _kernel():
    global _compiled
    if _compiled is None:
        try:
            from numba import njit
        except ImportError:
            _compiled = False
        else:
            # not cacheable: the function's address is part of the compiled code
            @njit(nogil=True)
            def advise_runs(fd, first, counts, page, advice):
                failed = 0
                for i in range(first.shape[0]):
                    failed += _fadvise(fd, first[i] * page, counts[i] * page, advice) != 0
                return failed

            _compiled = advise_runs
    return _compiled


def advise(fd: int, first: np.ndarray, counts: np.ndarray, page: int, advice: int = os.POSIX_FADV_WILLNEED):
    """``posix_fadvise(fd, first[i] * page, counts[i] * page, advice)`` for every run i (int64
    arrays); advice is a hint, so a failed call is ignored, as the page faults read what it missed."""
    k = _kernel()
    if k:
        k(int(fd), first.astype(np.int64, copy=False), counts.astype(np.int64, copy=False), int(page), int(advice))
        return
    for f, c in zip(first.tolist(), counts.tolist()):
        os.posix_fadvise(fd, f * page, c * page, advice)
