"""Disk Sparse Adam optimizers: lazy Adam for sparse embedding tables, moments in memory-mapped files.

Each is its constructor plus a choice of update rule (``rules.py``); the step, the state files,
staging and checkpoints are the shared machinery of ``base.py``. The pure rules are in
``reference.py``.
"""

from __future__ import annotations

from . import rules
from .base import DiskSparseOptimizer
from .store import StateFileError  # noqa: F401  (re-exported for users' except clauses)


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
            ``nn.EmbeddingBag(sparse=True).weight``), or 1-D ones as ``SparseAdam`` takes them (kept
            as N x 1 tables), or dicts defining parameter groups. Gradients may be row-sparse or
            element-sparse (``sparse_dim == 2``, as ``dense.to_sparse()`` gives); only the elements in
            the gradient change, as in ``SparseAdam``. ``copy.deepcopy`` gives an independent
            optimizer with a private copy of the state (refused for a fixed ``state_dir``).
        lr (float): learning rate. (Default: 1e-3)
        betas (Tuple[float, float]): decay rates of the first and second moments. (Default: (0.9, 0.999))
        eps (float): added to ``sqrt(v)`` in the denominator. (Default: 1e-8)
        maximize (bool): maximize the objective instead of minimizing. (Default: False)
        state_dir (str or None): directory of the state files; ``None`` makes a private temporary
            directory under ``tempfile.gettempdir()`` (``$TMPDIR``, else ``/tmp``) removed by
            ``close()``; those of killed processes are removed when the next one is made
            (``state_dirs.py``). A directory that already holds state files is refused unless
            ``resume=True``. On a RAM filesystem (tmpfs, ramfs) the state lives in memory: refused
            beyond the memory available, warned about beyond a quarter of the limit. (Default: None)
        resume (bool): continue from the state files in ``state_dir`` (each must be clean and match
            its parameter; its header holds the step it continues from; missing ones start fresh).
            Without it an existing state_dir raises: a second run of a script must not silently
            continue the first one's moments. (Default: False)
        backend (str): ``"torch"`` (``torch_ops``, any device), ``"numba"`` (``numba_ops``: CPU,
            float32/float64 weights), ``"triton"`` (``triton_ops``: float32/bfloat16 weights) or
            ``"auto"``: Triton for CUDA weights, numba for CPU weights where it is installed, torch
            otherwise (and for weights the chosen one cannot take). Resolved at construction. All
            give SparseAdam's update; torch and numba bitwise. (Default: "auto")
        huge_pages (bool or None): map the state files with transparent huge pages (2 MiB), which
            makes warm steps faster (fewer TLB misses) where the kernel supports huge pages for file
            mappings, but makes every page-cache miss read 2 MiB: only for state that stays in RAM.
            ``None``: when the optimizer's state files together are at most a quarter of the memory
            limit (physical RAM, or the container's cgroup limit if smaller).
            (Default: None)
        bitwise (bool): on CPU, give every bit of ``torch.optim.SparseAdam``: the square root is
            torch's own (MKL's vector sqrt, not always correctly rounded; called on tiles of rows
            inside the kernel where torch's library exposes it, else ``Tensor.sqrt_`` in a separate
            pass), and rows that occur three times or more in a gradient are summed in
            ``Tensor.sort``'s order, as ``coalesce`` sums them. ``False`` (numba backend) takes a
            correctly rounded sqrt and a stable radix sort's order, which is faster
            (``experiments/dsa_throughput.py``, variant ``warm-fused``); results then differ from
            SparseAdam's only by the rounding of that sqrt and of those sums (within the 1e-6 of
            the trajectory tests). A param-group option.
            (Default: True)

        staging (bool or None): stage each step's records through persistent pinned and device
            buffers with background prefetch (``pipeline.py``); ``None``: for CUDA weights.
            (Default: None)
        state_format (str): ``"exact"``: record ``[m | v]`` in the state dtype, SparseAdam's update
            and state dicts. ``"compact"``: record of ``D + 8`` to ``D + 11`` bytes per row
            (``compact.py``): m as int8 codes with one scale per row, one v per row (the mean of g²
            over the row, FBGEMM's row-wise Adam); the update of ``reference.compact_adam_rows``, in
            float32, for float32/bfloat16/float16 weights and row-sparse gradients; backends
            torch and numba (float32 weights); state dicts hold ``exp_avg_scale``, ``exp_avg_sq``
            (N x 1) and ``exp_avg_codes`` (int8, N x D). A state file remembers its format; one of
            the other format is refused. (Default: "exact")

    Use ``flush()`` for a clean on-disk point, ``close()`` (or ``with``) when done; checkpoints via
    ``state_dict()``/``load_state_dict()`` as with any optimizer.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, maximize=False, state_dir=None,
                 backend="auto", huge_pages=None, bitwise=True, staging=None, resume=False, state_format="exact"):
        defaults = dict(lr=lr, betas=betas, eps=eps, maximize=maximize, bitwise=bitwise)
        super().__init__(params, defaults, rules.rule("adam", state_format, type(self).__name__),
                         state_dir=state_dir, backend=backend, huge_pages=huge_pages, staging=staging,
                         resume=resume)


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
        resume (bool): as in :class:`DiskSparseAdam`. (Default: False)
        backend (str): ``"torch"``, ``"numba"`` (``numba_ops``: CPU, float32/float64 weights, one
            fused pass per row), ``"triton"`` (float32/bfloat16 weights, rows up to
            ``triton_ops.MAX_BALL_D`` wide) or ``"auto"`` (Triton for CUDA weights, numba for CPU
            weights where it is installed, torch otherwise). (Default: "auto")
        huge_pages (bool or None): as in :class:`DiskSparseAdam`. (Default: None)
        staging (bool or None): as in :class:`DiskSparseAdam`. (Default: None)
        state_format (str): ``"exact"`` (record ``[m | v]``, D + 1 values) or ``"compact"``: m as
            int8 codes with one scale per row, v as it is (``compact.py``, update
            ``reference.compact_riemannian_adam_rows``, backends torch and numba). (Default: "exact")
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, c=1.0, exact=False, state_dir=None,
                 backend="auto", huge_pages=None, staging=None, resume=False, state_format="exact"):
        defaults = dict(lr=lr, betas=betas, eps=eps, c=c, exact=exact)
        super().__init__(params, defaults, rules.rule("ball", state_format, type(self).__name__),
                         state_dir=state_dir, backend=backend, huge_pages=huge_pages, staging=staging,
                         resume=resume)
