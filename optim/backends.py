"""The backend contract shared by every optimizer of this package.

``backend`` takes the same values everywhere:

* ``"torch"``: in-place PyTorch ops, any device; the path every other one is checked against.
* ``"numba"``: compiled CPU kernels (numba, cached on disk after the first run); CPU tensors only.
* ``"triton"``: fused Triton kernels; CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was
  set before Triton was imported (how the tests run the kernels).
* ``"auto"``: Triton for CUDA tensors, numba for CPU tensors where numba is installed, torch otherwise.

An optimizer resolves each parameter's backend when the parameter is added (at construction, or
``add_param_group``), with :func:`choose_backend`: the device decides what is available
(:func:`resolve_backend`), the optimizer says what the chosen path cannot take, ``"auto"`` then falls
back to torch, and a backend asked for by name is refused with the reason instead. A choice that cannot
run raises there, not at the first step. ``opt.backend_of(p)`` tells which path updates ``p``.
"""

from __future__ import annotations

import functools
from typing import Callable
import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "numba", "triton")


@functools.cache
def numba_available() -> bool:
    """True when numba is installed (the compiled CPU kernels can be built)."""
    return importlib.util.find_spec("numba") is not None


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """True when Triton kernels run on CPU tensors through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(device: torch.device) -> bool:
    """True when a Triton kernel can run on tensors of ``device``."""
    if not _triton_installed():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and triton_interpreted()


def resolve_backend(backend: str, device: torch.device | str, *, owner: str = "optimizer") -> str:
    """The concrete backend ("torch", "numba" or "triton") that ``backend`` means for ``device``.

    ``owner`` names the optimizer in error messages. Raises ``ValueError`` for an unknown name and
    ``RuntimeError`` for a backend that cannot run on ``device`` here.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{owner}: backend must be one of {BACKENDS}, got {backend!r}")
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda" and _triton_installed():
            return "triton"
        if device.type == "cpu" and numba_available():
            return "numba"
        return "torch"
    if backend == "numba":
        if device.type != "cpu":
            raise RuntimeError(f"{owner}: backend='numba' runs on CPU tensors, got {device}; "
                               "use backend='auto' or 'triton'")
        if not numba_available():
            raise RuntimeError(f"{owner}: backend='numba' needs numba (pip install numba); "
                               "use backend='torch'")
    if backend == "triton" and not triton_available(device):
        why = ("Triton is not installed" if not _triton_installed()
               else f"tensors on {device} need CUDA, or TRITON_INTERPRET=1 set before Triton is imported")
        raise RuntimeError(f"{owner}: backend='triton' cannot run here: {why}; use backend='torch'")
    return backend


def choose_backend(backend: str, device: torch.device | str, why_not: Callable[[str], str | None], *,
                   owner: str, what: str) -> str:
    """The backend that updates one parameter (or group) on ``device``.

    ``why_not(name)`` says why the concrete backend ``name`` cannot update it (None if it can); ``what``
    names it in the error ("parameter 3 (shape (10, 4), dtype torch.float64)"). Under ``"auto"`` a
    refusal falls back to ``"torch"``; a backend asked for by name is never swapped for another:
    ``ValueError`` with the reason.
    """
    name = resolve_backend(backend, device, owner=owner)
    why = why_not(name)
    if why is not None and backend == "auto" and name != "torch":
        name, why = "torch", why_not("torch")
    if why is not None:
        advice = "" if name == "torch" or why_not("torch") is not None else "; use backend='torch' (or 'auto')"
        raise ValueError(f"{owner}: backend={name!r} cannot update {what}: {why}{advice}")
    return name
