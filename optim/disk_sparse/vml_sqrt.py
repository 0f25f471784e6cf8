"""The square root torch's CPU ``sqrt`` computes, callable from compiled kernels.

Torch builds with MKL run float32/float64 ``Tensor.sqrt`` on contiguous CPU tensors through MKL's
vector math library (``vmsSqrt``/``vmdSqrt`` with ``VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE``,
as in ATen's ``cpu/vml.h``). Its results are not always correctly rounded (a share of inputs, which
depends on the CPU and the range of inputs, differs from IEEE sqrt in the last bit), so a kernel
that must match ``torch.optim.SparseAdam`` bit for bit has to call that very function. This
module finds it in torch's own library and returns its address, after checking on fresh random
inputs (every exponent range, zeros, subnormals, several alignments and lengths)
that it reproduces ``torch.sqrt`` bitwise, per element and independently of the length of the call.
Where torch has no MKL (ARM, macOS builds) or the check fails, ``address`` returns None and callers
keep torch's own sqrt on a tensor.

MKL threads a vector call over its OpenMP pool when the process allows more than one thread,
which on the small tiles of the kernel costs more than the sqrt. ``threads_local_address`` gives
``MKL_Set_Num_Threads_Local`` so that the kernel can ask for one thread in the calling thread
only, and put the previous setting back.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

# mkl_vml_defines.h: VML_HA 0x2, VML_ERRMODE_IGNORE 0x100, VML_FTZDAZ_OFF 0x140000.
MODE = 0x2 | 0x100 | 0x140000
_SYMBOLS = {torch.float32: "vmsSqrt", torch.float64: "vmdSqrt"}
_LENGTHS = (1, 3, 16, 37, 128, 1000, 2048, 4099)


@functools.lru_cache(maxsize=None)
def _library():
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.CDLL(path)  # already loaded by ``import torch``: the same handle
    except OSError:
        return None


def _probe_values(dtype, n=1 << 15, seed=0):
    """Squared-gradient-like inputs: log-uniform over the whole finite range, plus 0 and subnormals."""
    gen = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    lo, hi = torch.log(torch.tensor(info.tiny, dtype=torch.float64)), torch.log(torch.tensor(info.max / 4, dtype=torch.float64))
    x = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(float(lo), float(hi), generator=gen)).to(dtype)
    x[:64] = 0.0
    x[64:128] = info.tiny * torch.rand(64, generator=gen, dtype=dtype)  # subnormal
    x[128:1128] = torch.rand(1000, generator=gen, dtype=dtype) ** 2  # the range of v
    return x[torch.randperm(n, generator=gen)]


def _agrees_with_torch(fn, dtype) -> bool:
    x = _probe_values(dtype)
    whole = x.sqrt()
    out = torch.full_like(x, float("nan"))
    size = x.element_size()
    start = 0
    for i, length in enumerate(_LENGTHS * 4):  # every length at several alignments
        start = (start + length + i) % (x.numel() - length)
        fn(length, x.data_ptr() + start * size, out.data_ptr() + start * size, MODE)
        got = out[start:start + length]
        if not (torch.equal(got, whole[start:start + length]) and torch.equal(got, x[start:start + length].sqrt())):
            return False
    fn(x.numel(), x.data_ptr(), out.data_ptr(), MODE)
    return torch.equal(out, whole)


@functools.lru_cache(maxsize=None)
def threads_local_address() -> int:
    """Address of ``int MKL_Set_Num_Threads_Local(int n)`` (returns the previous thread-local count;
    0 clears it), or 0 where torch's library has none."""
    lib = _library()
    fn = getattr(lib, "MKL_Set_Num_Threads_Local", None) if lib is not None else None
    return ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else 0


@functools.lru_cache(maxsize=None)
def address(dtype: torch.dtype) -> int | None:
    """Address of the C function ``void f(int n, const T *x, T *y, int64 mode)`` that computes
    torch's CPU sqrt for ``dtype`` (call it with ``MODE``), or None where there is none or it does
    not reproduce ``torch.sqrt`` bitwise on the CPU at hand."""
    lib = _library() if dtype in _SYMBOLS else None
    fn = getattr(lib, _SYMBOLS[dtype], None) if lib is not None else None
    if fn is None:
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    if not _agrees_with_torch(fn, dtype):
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value
