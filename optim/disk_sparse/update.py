"""One table's update from its sparse gradient: the step function of ``base.DiskSparseOptimizer``.

``update_table`` takes the route (``routes.Route``) chosen for the parameter. A backend with a fused
update straight from the uncoalesced gradient (numba, for CPU weights) takes the whole step: the
rows' cold pages are read ahead together, then one compiled pass sums each row's duplicates and
updates its record in the mapped file and its weight row in place. Otherwise the gradient is
coalesced into sorted unique rows (``torch_ops.coalesce_rows``), the stager brings those rows'
records next to the weight rows, the backend's row update changes both in place, and the stager
writes the records back. Untouched rows are never read.
"""

from __future__ import annotations

import torch

from .._torch_private import sparse_parts
from .table import cols
from .torch_ops import coalesce_rows


def update_table(p, g, route, store, step: int, hyper: dict):
    """Update ``p`` and its records in ``store`` (``RowStateFile``) from its sparse gradient ``g`` at
    ``step``, through ``route``; ``hyper``: the rule's keyword arguments for ``p``'s group."""
    if sparse_parts(g)[1].shape[0] == 0:  # an empty gradient: the step counts, nothing changes
        return
    if g.sparse_dim() == 2:
        _update_elements(p, g, route, store, step, hyper)
        return
    indices, values = sparse_parts(g)  # uncoalesced: duplicates are summed below
    vals = values.reshape(values.shape[0], cols(p))  # a 1-D table is updated as N x 1
    w_all = p if p.dim() == 2 else p.unsqueeze(1)
    if route.sparse_fn is not None:
        route.stager.read_ahead_if_cold(indices[0].cpu())  # under no lock: it holds no buffer
        route.sparse_fn(w_all, indices[0], vals.to(p.dtype), store.writable(), step, **hyper)
        torch.autograd.graph.increment_version(p)  # written by compiled code: autograd must know
        return
    rows = indices[0]
    if not g.is_coalesced():
        rows, vals = coalesce_rows(rows, vals)
    _update_rows(route, store, w_all, rows, vals, step, hyper)


def _update_elements(p, g, route, store, step, hyper):
    """An element-sparse gradient (``dense.to_sparse()``): its rows are updated whole, then only
    the elements it holds keep the new weight and moments, as SparseAdam updates them."""
    g = g.coalesce()
    (r, c), vals = sparse_parts(g)
    rows, inv = torch.unique(r, return_inverse=True)
    dense = torch.zeros(rows.numel(), p.shape[1], dtype=compute_dtype(store), device=vals.device)
    dense[inv, c] = vals.to(dense.dtype)
    mask = torch.zeros(dense.shape, dtype=torch.bool, device=vals.device)
    mask[inv, c] = True
    _update_rows(route, store, p, rows, dense, step, hyper, mask=mask)


def _update_rows(route, store, w_all, rows, vals, step, hyper, mask=None):
    """Stage the records of sorted unique ``rows``, update them and their weight rows with the
    backend's row rule, write both back; with ``mask``, only its elements keep the update."""
    stager, rows_fn = route.stager, route.rows_fn
    rows_cpu = rows.cpu()
    with stager.lock:  # an announcement from another thread waits until the records are back
        host = stager.acquire(rows_cpu)
        rec = stager.to_device(host)
        w = stager.weight_rows(w_all, rows)
        if mask is not None:
            w_old, rec_old = w.clone(), rec.clone()
        rows_fn(w, vals.to(compute_dtype(store)).contiguous(), rec, step, **hyper)
        if mask is not None:
            w = torch.where(mask, w, w_old)
            rec_mask = mask.to(rec.device).repeat(1, rec.shape[1] // mask.shape[1])
            rec.copy_(torch.where(rec_mask, rec, rec_old))
        w_all.index_copy_(0, rows, w)
        stager.commit(rows_cpu, rec, host)


def compute_dtype(store) -> torch.dtype:
    """The dtype of the row update: the state's, float32 for byte records."""
    dtype = store.dtype
    return dtype if dtype.is_floating_point else torch.float32
