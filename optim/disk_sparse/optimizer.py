"""Disk Sparse Adam optimizers: lazy Adam for sparse embedding tables, moments in memory-mapped files.

The step, the state files and checkpoints are the shared machinery of ``base.py``; each optimizer
here says what a row's record holds and how a row is updated: a pure function (``reference.py``,
``poincare.py``), its in-place torch twin, a Triton kernel (``kernels.py``) or, for Adam on CPU,
the fused Numba kernels (``cpu_kernels.py``).
"""

from __future__ import annotations

import math

import torch

from .base import EXP_AVG, EXP_AVG_SQ, STEP, DiskSparseOptimizer, coalesce_rows  # noqa: F401
from .store import StateFileError  # noqa: F401  (re-exported for users' except clauses)


def adam_rows_torch_(w, g, state, step, *, lr, beta1, beta2, eps, maximize=False):
    """In-place twin of ``reference.sparse_adam_rows`` on records ``state = [m | v]``.

    Updates ``state`` in place and returns the weight increment (add it to the rows of ``w``); the
    operations and their order are those of the reference, so results are bitwise equal.
    ``w`` is unused (the increment is added by the caller with ``index_add_``, as SparseAdam does).
    """
    d = g.shape[1]
    m, v = state[:, :d], state[:, d:]
    if maximize:
        g = -g
    u_m = torch.sub(g, m).mul_(1 - beta1)
    u_v = g.pow(2).sub_(v).mul_(1 - beta2)
    m.add_(u_m)  # m + u_m == u_m + m_old: the numerator of the reference
    v.add_(u_v)
    denom = torch.sqrt(v, out=u_v).add_(eps)
    step_size = lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
    return torch.div(m, denom, out=u_m).mul_(-step_size)


class DiskSparseAdam(DiskSparseOptimizer):
    r"""Lazy Adam for sparse embedding tables, a drop-in for ``torch.optim.SparseAdam``.

    For each row ``i`` present in the (coalesced) sparse gradient ``g`` at step ``t`` of its parameter::

        m_i <- m_i + (1 - beta1) (g_i - m_i)
        v_i <- v_i + (1 - beta2) (g_i^2 - v_i)
        w_i <- w_i - lr sqrt(1 - beta2^t) / (1 - beta1^t) * m_i / (sqrt(v_i) + eps)

    exactly as ``torch.optim.SparseAdam`` computes it (same operations in the same order, so float32
    trajectories agree to the last rounding); rows absent from the gradient are neither read nor
    changed. Adam is from Kingma & Ba, "Adam: A Method for Stochastic Optimization" (2015); keeping
    the moments in memory-mapped files is the idea of Disk Sparse Adam (Assistentus/DSA).

    The moments of each parameter live in one file under ``state_dir`` (record ``[m | v]`` per row),
    so they cost no RAM beyond the page cache and no accelerator memory. Weights stay where they are
    (CPU or CUDA); for CUDA weights each step stages its rows' records through persistent pinned and
    device buffers (``optim/disk_sparse/pipeline.py``), so the optimizer's device memory is
    ``device_staging_bytes()``, O(rows per batch), and ``prefetch(next_indices)`` reads the next
    batch's records on a background thread. Not for dense gradients (use ``torch.optim.Adam``) or
    tables that fit in memory with their moments comfortably (``torch.optim.SparseAdam`` is then
    simpler).

    Args:
        params: iterable of 2-D floating-point parameters (``nn.Embedding(sparse=True).weight``,
            ``nn.EmbeddingBag(sparse=True).weight``) or dicts defining parameter groups.
        lr (float): learning rate. (Default: 1e-3)
        betas (Tuple[float, float]): decay rates of the first and second moments. (Default: (0.9, 0.999))
        eps (float): added to ``sqrt(v)`` in the denominator. (Default: 1e-8)
        maximize (bool): maximize the objective instead of minimizing. (Default: False)
        state_dir (str or None): directory of the state files; an existing one is resumed if its files
            are clean and match; ``None`` makes a private temporary directory removed by ``close()``.
            (Default: None)
        backend (str): ``"torch"`` (vectorised torch ops), ``"triton"`` (``optim.disk_sparse.kernels``)
            or ``"auto"``: Triton when the weights are on CUDA; on CPU the fused Numba kernels of
            ``optim.disk_sparse.cpu_kernels`` when Numba is installed (float32/float64), else torch.
            All give SparseAdam's update; on CPU both are bitwise equal to it. (Default: "auto")
        huge_pages (bool or None): map the state files with transparent huge pages (2 MiB), which
            makes warm steps faster (fewer TLB misses) where the kernel supports huge pages for file
            mappings, but makes every page-cache miss read 2 MiB: only for state that stays in RAM.
            ``None``: for each state file of at most a quarter of the memory limit (physical RAM,
            or the container's cgroup limit if smaller).
            (Default: None)
        bitwise (bool): on CPU, give every bit of ``torch.optim.SparseAdam``: the square root is
            torch's own (MKL's vector sqrt, not always correctly rounded; called on tiles of rows
            inside the kernel where torch's library exposes it, else ``Tensor.sqrt_`` in a separate
            pass), and rows that occur three times or more in a gradient are summed in
            ``Tensor.sort``'s order, as ``coalesce`` sums them. ``False`` takes a correctly rounded
            sqrt and a stable radix sort's order: training in ``experiments/dsa_throughput.py`` ran
            11% (seed config) and 41% (KG config) more samples/s, and results differ from
            SparseAdam's only by the rounding of that sqrt and of those sums (within the 1e-6 of
            the trajectory tests). A param-group option.
            (Default: True)

    Use ``flush()`` for a clean on-disk point, ``close()`` (or ``with``) when done; checkpoints via
    ``state_dict()``/``load_state_dict()`` as with any optimizer.
    """

    _kernel_name = "adam_rows_"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, maximize=False, state_dir=None,
                 backend="auto", huge_pages=None, bitwise=True):
        _check_hyper(lr, betas, eps)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, maximize=bool(maximize), bitwise=bool(bitwise))
        super().__init__(params, defaults, state_dir=state_dir, backend=backend, huge_pages=huge_pages)

    def _state_width(self, cols):
        return 2 * cols

    def _state_views(self, records, cols):
        return {EXP_AVG: records[:, :cols], EXP_AVG_SQ: records[:, cols:]}

    def _hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(lr=_scalar(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                    maximize=group["maximize"])

    def _fused_cpu(self, p, g, group, step):
        if self.backend != "auto" or p.is_cuda or p.dtype not in (torch.float32, torch.float64):
            return False
        from . import cpu_kernels

        if not cpu_kernels.AVAILABLE or g._values().dtype != p.dtype:
            return False
        store = self._stores[p]
        store.mark_dirty()
        cpu_kernels.adam_rows_cpu_(p, g._indices()[0], g._values(), store.records.numpy(), step,
                                   bitwise=group.get("bitwise", True), **self._hyper(group))
        return True

    def _update_torch(self, p, rows, g, rec, step, group):
        delta = adam_rows_torch_(None, g, rec, step, **self._hyper(group))
        if p.dtype == rec.dtype:
            p.index_add_(0, rows, delta)  # unique rows: w + delta, as SparseAdam's sparse add
        else:
            p.index_copy_(0, rows, p.index_select(0, rows).to(rec.dtype).add_(delta).to(p.dtype))


def _scalar(x):
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _check_hyper(lr, betas, eps):
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("lr: a tensor learning rate must have one element")
    if not _scalar(lr) > 0.0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")


class DiskSparseRiemannianAdam(DiskSparseOptimizer):
    r"""Riemannian Adam on the Poincaré ball for sparse embedding tables, moments in files.

    For each row ``x`` present in the (coalesced) sparse gradient ``g`` at step ``t`` (Bécigneul &
    Ganea, "Riemannian Adaptive Optimization Methods", ICLR 2019; the update of
    ``geoopt.optim.SparseRiemannianAdam``)::

        x  <- project(x)                          (a row nudged outside the ball cannot become NaN)
        r   = g / lambda_x^2                      (Riemannian gradient, lambda_x = 2 / (1 - c|x|^2))
        m  <- beta1 m + (1 - beta1) r
        v  <- beta2 v + (1 - beta2) lambda_x^2 |r|^2        (one number per row)
        u   = -lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
        x, m <- retraction + transport (exact=False) or expmap + transport (exact=True) along u

    on the ball of curvature ``-c`` (``geoopt.PoincareBall(c)`` / ``PoincareBallExact(c)``). Plain
    ``nn.Embedding(sparse=True)`` weights; no ManifoldParameter is needed. A row's record on disk is
    ``[m (D) | v (1)]``. Not for Euclidean tables (use :class:`DiskSparseAdam`) or other manifolds.

    Args:
        params: iterable of 2-D floating-point parameters whose rows lie in the ball, or dicts
            defining parameter groups.
        lr (float): learning rate. (Default: 1e-3)
        betas (Tuple[float, float]): decay rates of the first and second moments. (Default: (0.9, 0.999))
        eps (float): added to the denominator. (Default: 1e-8)
        c (float): the ball's curvature is ``-c``; its radius ``1/sqrt(c)``. (Default: 1.0)
        exact (bool): exponential map instead of the retraction. (Default: False)
        state_dir (str or None): as in :class:`DiskSparseAdam`. (Default: None)
        backend (str): ``"torch"``, ``"triton"`` or ``"auto"``. (Default: "auto")
        huge_pages (bool or None): as in :class:`DiskSparseAdam`. (Default: None)
    """

    _kernel_name = "riemannian_adam_rows_"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, c=1.0, exact=False, state_dir=None,
                 backend="auto", huge_pages=None):
        _check_hyper(lr, betas, eps)
        if not float(c) > 0:
            raise ValueError(f"c (the ball's curvature is -c) must be > 0, got {c}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, c=float(c), exact=bool(exact))
        super().__init__(params, defaults, state_dir=state_dir, backend=backend, huge_pages=huge_pages)

    def _state_width(self, cols):
        return cols + 1

    def _state_views(self, records, cols):
        return {EXP_AVG: records[:, :cols], EXP_AVG_SQ: records[:, cols:]}

    def _hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(lr=_scalar(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"], c=group["c"],
                    exact=group["exact"])

    def _use_triton(self, p):
        use = super()._use_triton(p)
        if use and self.backend == "auto":  # rows wider than one kernel program: the torch path
            limit = getattr(self._kernel_module(), "_MAX_BALL_D", None)
            return limit is None or p.shape[1] <= limit
        return use

    def _update_torch(self, p, rows, g, rec, step, group):
        from .poincare import riemannian_adam_rows

        d = p.shape[1]
        w = p.index_select(0, rows).to(rec.dtype)
        w, m, v = riemannian_adam_rows(w, g, rec[:, :d], rec[:, d:], step, **self._hyper(group))
        rec[:, :d] = m
        rec[:, d:] = v
        p.index_copy_(0, rows, w.to(p.dtype))
