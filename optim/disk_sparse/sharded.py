"""Embedding tables sharded by rows over ``torch.distributed``, each shard stepped by its own Disk Sparse Adam.

Rank ``r`` of a group of ``W`` owns the contiguous rows ``[r * C, min((r + 1) * C, N))`` with
``C = ceil(N / W)`` (``torch.chunk``'s split, which is DTensor's ``Shard(0)``, so checkpoints reshard
through ``torch.distributed.checkpoint``); the last ranks may own fewer rows, or none. Its weight shard
is an ordinary local ``nn.Parameter`` with sparse gradients, so ``DiskSparseAdam`` steps it locally with
its state in that rank's own directory.

A lookup (``ShardedEmbedding.forward``) is three ``all_to_all_single`` calls (gloo and NCCL both have
it): a header, the row ids, and the rows coming back. The header carries the counts of unique rows
each rank needs from each owner, an error flag (so a bad index on one rank raises on every rank
instead of leaving the others blocked in the next collective) and the call's tag (below). The
backward exchanges a header too, then sums each rank's gradient rows per unique row and sends them
to their owners (one more ``all_to_all_single``), where they form the local shard's sparse
gradient; a row that several ranks looked up appears once per rank and the optimizer's coalesce
sums them, as ``torch.optim.SparseAdam`` sums duplicates.

Every lookup and its backward are collective: every rank must call forward and backward of a table
the same number of times, in the same order and in the same grad mode (as with DDP), also with an
empty batch. A rank cannot read another rank's rows on its own, so an evaluation on one rank
between training steps would pair its lookup with the other ranks' next step. The tag, (table,
kind) with kind one of "lookup with gradient", "lookup without gradient" and
"backward", makes such a mismatch an error raised on every rank that names each rank's call,
instead of an abort inside gloo or rows sent to the wrong call. To evaluate, every rank looks up
together under ``torch.no_grad()``; ranks with nothing to evaluate pass an empty index tensor.

Checkpoints (:func:`dcp_state_dict`, :func:`load_dcp_state_dict`) present the weight shards and the
optimizer's moments as DTensors, so ``dcp.save`` writes each rank's rows and ``dcp.load`` reads them
into any number of ranks. :func:`open_optimizer` opens every rank's state directory together and
refuses on every rank if one rank's files cannot be used (dirty after a kill, locked, at another
step), so one rank can never continue from files the others have left behind.
"""

from __future__ import annotations

import math
import os
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from . import weights
from .store import StateFileError

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_OK, _OUT_OF_RANGE, _BAD_DTYPE = 0, 1, 2
# the header's columns (one row per destination rank) and the kinds of call a tag names
_COUNT, _ERROR, _TABLE, _KIND = range(4)
_LOOKUP_GRAD, _LOOKUP_NO_GRAD, _BACKWARD = 1, 2, 3
_KIND_NAMES = {_LOOKUP_GRAD: "a lookup with gradient", _LOOKUP_NO_GRAD: "a lookup without gradient",
               _BACKWARD: "a backward"}
_next_serial = 0  # the serial the next table of this process proposes (the ranks take the largest)


def row_range(num_rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of ``rank``: ``torch.chunk``'s split of ``num_rows`` into ``world`` parts."""
    chunk = math.ceil(num_rows / world)
    return min(rank * chunk, num_rows), min((rank + 1) * chunk, num_rows)


def route(flat: torch.Tensor, chunk: int, world: int):
    """Sorted unique rows of ``flat``, the inverse map to them, and how many go to each owner rank."""
    uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)  # sorted: grouped by owner
    counts = torch.bincount(torch.div(uniq, chunk, rounding_mode="floor"), minlength=world)
    return uniq, inverse, counts


def _index_error(indices: torch.Tensor, num_rows: int) -> int:
    if indices.dtype not in _INT_DTYPES:
        return _BAD_DTYPE
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_rows):
        return _OUT_OF_RANGE
    return _OK


class _Lookup(torch.autograd.Function):
    """Rows of a table sharded over ``mod.group`` for this rank's indices; sparse gradients back."""

    @staticmethod
    def forward(ctx, weight, indices, mod, with_grad):
        flat = indices.reshape(-1)
        err = _index_error(flat, mod.num_rows)
        if err == _OK:
            uniq, inverse, send = route(flat.to(torch.int64), mod.chunk, mod.world)
        else:
            uniq = inverse = torch.zeros(0, dtype=torch.int64)
            send = torch.zeros(mod.world, dtype=torch.int64)
        got = _exchange_header(mod, _LOOKUP_GRAD if with_grad else _LOOKUP_NO_GRAD, send, err)
        _raise_if_any(got[:, _ERROR], indices, mod)
        recv, send = got[:, _COUNT].tolist(), send.tolist()
        ids = torch.empty(sum(recv), dtype=torch.int64)
        dist.all_to_all_single(ids, uniq, recv, send, group=mod.group)
        local = ids - mod.row_start
        rows = torch.empty(uniq.numel(), mod.dim, dtype=weight.dtype)
        dist.all_to_all_single(rows, weight.detach().index_select(0, local), send, recv, group=mod.group)
        ctx.mod, ctx.splits = mod, (send, recv)
        ctx.save_for_backward(inverse, local)
        mod._sent(ids.element_size(), send)  # ids to their owners
        mod._sent(rows.element_size() * mod.dim, recv)  # rows back to the ranks that asked
        return rows.index_select(0, inverse).reshape(*indices.shape, mod.dim)

    @staticmethod
    def backward(ctx, grad_out):
        mod, (send, recv) = ctx.mod, ctx.splits
        inverse, local = ctx.saved_tensors
        _exchange_header(mod, _BACKWARD, torch.zeros(mod.world, dtype=torch.int64), _OK)
        grad_out = grad_out.reshape(-1, mod.dim)
        summed = torch.zeros(sum(send), mod.dim, dtype=grad_out.dtype)
        summed.index_add_(0, inverse, grad_out)  # one row per unique index of this rank
        got = torch.empty(local.numel(), mod.dim, dtype=grad_out.dtype)
        dist.all_to_all_single(got, summed, recv, send, group=mod.group)
        mod._sent(got.element_size() * mod.dim, send)  # gradient rows to their owners
        grad = torch.sparse_coo_tensor(local.unsqueeze(0), got, (mod.row_end - mod.row_start, mod.dim),
                                       check_invariants=False)  # ids were checked in the forward
        return grad, None, None, None


def _exchange_header(mod, kind: int, counts: torch.Tensor, err: int) -> torch.Tensor:
    """Send every rank this rank's header row (``counts[r]`` to rank ``r``, the error flag, and the
    tag of this call: table and kind) and return every rank's row to this one. Raises on every rank
    if the ranks' tags differ: their calls were paired by mistake."""
    tag = torch.tensor([mod.serial, kind], dtype=torch.int64)
    head = torch.cat([counts.unsqueeze(1), torch.full_like(counts, err).unsqueeze(1), tag.expand(mod.world, 2)], 1)
    got = torch.empty_like(head)
    dist.all_to_all_single(got, head, group=mod.group)
    mod._sent(head.shape[1] * head.element_size(), [1] * mod.world)
    tags = [tuple(row) for row in got[:, _TABLE:].tolist()]
    if len(set(tags)) > 1:
        raise RuntimeError(_mismatch_message(mod, tags))
    return got


def _mismatch_message(mod, tags: list) -> str:
    def call(table, kind):
        return f"{_KIND_NAMES.get(kind, f'an unknown call ({kind})')} of table {table}"

    by_call = {}
    for r, tag in enumerate(tags):
        by_call.setdefault(tag, []).append(r)
    ranks = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} in {call(*tag)}"
                      for tag, rs in by_call.items())
    return (f"ShardedEmbedding: the ranks' collective calls do not match ({ranks}; here rank {mod.rank}). "
            "Every rank must call forward and backward of each table the same number of times, in the same "
            "order and the same grad mode; a lookup on one rank alone (an evaluation between training steps) "
            "pairs with the other ranks' next call. Evaluate on every rank together under torch.no_grad() "
            "(ranks with nothing to look up pass an empty index tensor). Every rank raises this error, so "
            "none goes on alone")


def _raise_if_any(errors: torch.Tensor, indices: torch.Tensor, mod):
    """Raise on every rank when any rank's indices were refused (each rank holds every rank's flag)."""
    bad = {r: int(e) for r, e in enumerate(errors.tolist()) if e != _OK}
    if not bad:
        return
    what = {_OUT_OF_RANGE: f"indices outside [0, {mod.num_rows})",
            _BAD_DTYPE: "indices of a non-integer dtype"}
    msg = "ShardedEmbedding: " + "; ".join(f"rank {r} got {what[e]}" for r, e in sorted(bad.items()))
    if mod.rank in bad:
        msg += f" (here: dtype {indices.dtype}, shape {tuple(indices.shape)})"
    raise (TypeError if _BAD_DTYPE in bad.values() else IndexError)(msg)


class ShardedEmbedding(nn.Module):
    """An ``num_rows x dim`` embedding table whose rows are spread over the ranks of a process group.

    ``forward(indices)`` takes any integer tensor of global row ids on each rank (any shape, empty
    included) and returns their rows, ``indices.shape + (dim,)``, as ``nn.Embedding`` does. The local
    shard ``weight`` (rows ``row_start:row_end``) gets sparse gradients: step it with
    ``DiskSparseAdam`` (:func:`open_optimizer`) or any optimizer that takes them. Initialised
    N(0, 1) like ``nn.Embedding``; to start from a given full table ``T``, copy
    ``T[row_start:row_end]`` into ``weight``.

    Collective: every rank calls ``forward`` (and its backward) of the table the same number of
    times, in the same order and the same grad mode; a call paired with another kind of call on
    another rank (a lookup on one rank alone, say an evaluation between training steps) raises
    ``RuntimeError`` on every rank naming each rank's call. To evaluate, look up on every rank under
    ``torch.no_grad()``, with an empty index tensor where a rank has nothing to look up.

    Not for tables that fit on every rank with their state (plain ``nn.Embedding(sparse=True)`` under
    DDP is simpler, see README); ``padding_idx``, ``max_norm`` and bags are not supported.

    Args:
        num_rows (int): rows of the whole table.
        dim (int): values per row.
        process_group: the group the table is sharded over. (Default: the default group)
        dtype: dtype of the weights. (Default: ``torch.get_default_dtype()``)
        weight_dir (str or None): keep this rank's shard in the file
            ``weight_dir/rank{r}-of-{W}.{dtype}.weight``, memory-mapped, so the weights cost page
            cache instead of RAM: a weight file as ``mapped_embedding``'s (``weights.py``), with a
            header and a dirty flag, marked dirty by the optimizer's steps and flushed with its
            state, so a resume checks that both hold one step. An existing clean file of the right
            size is reopened with its weights. (Default: None, weights in RAM)

    ``exchanged_bytes`` counts the payload this rank has sent to other ranks (ids, rows, gradients),
    for measurements; ``reset_exchanged_bytes()`` sets it to zero.
    """

    def __init__(self, num_rows: int, dim: int, process_group=None, dtype=None, weight_dir=None):
        super().__init__()
        if num_rows < 1 or dim < 1:
            raise ValueError(f"ShardedEmbedding needs num_rows >= 1 and dim >= 1, got {num_rows} x {dim}")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        dtype = dtype or torch.get_default_dtype()
        # Collective: the ranks exchange rows by index, so a table of other sizes on one rank would
        # abort the group inside gloo at the first lookup; every rank refuses it here instead.
        global _next_serial
        tables = _everyone(self.group, ((int(num_rows), int(dim), str(dtype)), _next_serial))
        if len({t for t, _ in tables}) > 1:
            raise ValueError("ShardedEmbedding: the ranks build different tables (num_rows, dim, dtype by rank: "
                             + "; ".join(f"{r}: {t}" for r, (t, _) in enumerate(tables))
                             + "); every rank must give the same")
        # the table's name in the tags of its calls: the same on every rank of the group, distinct
        # from the other tables this process has made
        self.serial = max(n for _, n in tables)
        _next_serial = self.serial + 1
        self.num_rows, self.dim, self.chunk = int(num_rows), int(dim), math.ceil(num_rows / self.world)
        self.row_start, self.row_end = row_range(self.num_rows, self.world, self.rank)
        shape = (self.row_end - self.row_start, self.dim)
        self.weight_file, wf = None, None
        if weight_dir is None:
            weight, fresh = torch.empty(shape, dtype=dtype), True
        else:
            self.weight_file = os.path.join(os.fspath(weight_dir), f"rank{self.rank}-of-{self.world}."
                                            f"{str(dtype).removeprefix('torch.')}.weight")
            wf, fresh = _mapped(self.weight_file, shape, dtype)
            weight = wf.records
        if fresh:
            nn.init.normal_(weight)
            if wf is not None:
                wf.flush(0)
        self.weight = nn.Parameter(weight)
        if wf is not None:
            setattr(self.weight, weights.ATTR, wf)  # the optimizer flushes it with its state
            weakref.finalize(self, wf.close)
        self.exchanged_bytes = 0

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        with_grad = torch.is_grad_enabled() and self.weight.requires_grad  # then a backward follows
        return _Lookup.apply(self.weight, indices, self, with_grad)

    def _sent(self, item_bytes: int, counts: list):
        """Count ``counts[r]`` items of ``item_bytes`` sent to each rank ``r`` other than this one."""
        self.exchanged_bytes += item_bytes * (sum(counts) - counts[self.rank])

    def reset_exchanged_bytes(self):
        self.exchanged_bytes = 0

    def extra_repr(self):
        return (f"{self.num_rows}, {self.dim}, rows {self.row_start}:{self.row_end} on rank {self.rank} "
                f"of {self.world}")


def _mapped(path: str, shape: tuple, dtype) -> tuple:
    """The weight file (``weights.WeightFile``) of ``shape`` at ``path``, and whether it is new (then
    marked dirty until its first fill is flushed: a kill in between leaves it refused)."""
    from .store import HEADER_BYTES

    nbytes = HEADER_BYTES + math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    fresh = not os.path.exists(path)
    if not fresh and os.path.getsize(path) != nbytes:
        raise ValueError(f"ShardedEmbedding: weight file {path} has {os.path.getsize(path)} bytes, this "
                         f"shard needs {nbytes} ({shape[0]} rows x {shape[1]} {dtype}); another table's file?")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    wf = weights.WeightFile(path, shape[0], shape[1], dtype)
    if fresh:
        wf.mark_dirty()
    return wf, fresh


# ----------------------------------------------------------------------------------- optimizer state
def _tables(model: nn.Module) -> dict:
    """``{name: ShardedEmbedding}`` of ``model`` (the module itself included)."""
    found = {name: m for name, m in model.named_modules() if isinstance(m, ShardedEmbedding)}
    if not found:
        raise ValueError("no ShardedEmbedding in the given module")
    return found


def open_optimizer(model: nn.Module, state_dir, *, resume: bool = False, **kwargs):
    """``DiskSparseAdam`` over the weight shards of ``model``'s ``ShardedEmbedding`` tables, with this
    rank's state in ``state_dir/rank{r}-of-{W}``. Collective: every rank opens its directory, then
    all compare; if any rank failed (a dirty directory left by a killed rank, a locked or foreign
    one) or the ranks' files stand at different steps, every rank raises ``StateFileError`` naming
    the ranks, so no rank trains on while another is refused. ``kwargs`` go to ``DiskSparseAdam``.
    """
    from .optimizer import DiskSparseAdam

    tables = _tables(model)
    group = next(iter(tables.values())).group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    opt, error = None, None
    others = _other_world_dirs(state_dir, world) if resume else []
    try:
        if others:
            raise StateFileError(
                f"resume=True on {world} ranks, but {os.fspath(state_dir)} holds the state of another number "
                f"of ranks ({', '.join(others)}): row shards do not carry over. Restore a DCP checkpoint "
                "(dcp_state_dict / load_dcp_state_dict) into fresh state dirs on these ranks")
        opt = DiskSparseAdam([t.weight for t in tables.values()],
                             state_dir=os.path.join(os.fspath(state_dir), f"rank{rank}-of-{world}"),
                             resume=resume, **kwargs)
    except (StateFileError, OSError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    steps = None if opt is None else [opt.step_count(p) for g in opt.param_groups for p in g["params"]]
    everyone = _everyone(group, (error, steps))
    failed = {r: e for r, (e, _) in enumerate(everyone) if e is not None}
    at = {r: s for r, (_, s) in enumerate(everyone) if s is not None}
    if not failed and len({tuple(s) for s in at.values()}) <= 1:
        return opt
    if opt is not None:
        opt.close()
    why = ("; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())) if failed
           else f"the ranks' state files stand at different steps {at}")
    raise StateFileError(f"open_optimizer: the ranks' state cannot continue together ({why}). Restore "
                         "the last checkpoint on every rank (load_dcp_state_dict into fresh state dirs)")


def _other_world_dirs(state_dir, world) -> list:
    """The ``rank{r}-of-{W}`` directories in ``state_dir`` of a world size other than ``world``."""
    try:
        names = os.listdir(state_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith("rank") and "-of-" in n and not n.endswith(f"-of-{world}"))


# ----------------------------------------------------------------------------------- checkpoints
def _mesh(group):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "cpu")


def _sharded(local: torch.Tensor, table: ShardedEmbedding, mesh):
    """``local`` (this rank's rows of a per-row tensor) as a DTensor of the whole table's rows."""
    from torch.distributed.tensor import DTensor, Shard

    shape = (table.num_rows, *local.shape[1:])
    stride = torch.empty(0, *local.shape[1:]).stride() if local.dim() > 1 else (1,)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=tuple(stride))


def dcp_state_dict(model: nn.Module, opt) -> dict:
    """``{"model": {name.weight: DTensor}, "optim": {"state": {name.weight: {...}}, "param_groups":
    [...]}}`` for ``dcp.save``, and as the target of ``dcp.load`` (then :func:`load_dcp_state_dict`).

    Per-row state tensors become DTensors over the whole table; the step is a 0-dim int64 tensor, the
    same on every rank. For a table sharded over a subgroup, give ``dcp.save``/``dcp.load`` that
    ``process_group``. The weights and moments are views (the moments copy-on-write views of the
    state files, ``DiskSparseOptimizer.state_dict``): save before stepping again.
    """
    tables = _tables(model)
    index = _param_index(opt)
    if {id(p) for p in index} != {id(t.weight) for t in tables.values()}:
        raise ValueError("dcp_state_dict: the optimizer must hold exactly the weights of the model's "
                         "ShardedEmbedding tables (open_optimizer(model, ...) gives such an optimizer)")
    mesh = _mesh(next(iter(tables.values())).group)
    sd = opt.full_state_dict()
    weights, state = {}, {}
    for name, t in tables.items():
        key = f"{name}.weight" if name else "weight"
        weights[key] = _sharded(t.weight.detach(), t, mesh)
        entry = sd["state"].get(index[t.weight], {})
        state[key] = {k: (_sharded(v, t, mesh) if isinstance(v, torch.Tensor) and v.dim() >= 1
                          and v.shape[0] == t.weight.shape[0] else torch.as_tensor(v))
                      for k, v in entry.items()}
    names = {index[t.weight]: (f"{n}.weight" if n else "weight") for n, t in tables.items()}
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]]
    return {"model": weights, "optim": {"state": state, "param_groups": groups}}


def load_dcp_state_dict(model: nn.Module, opt, state_dict: dict):
    """Put a state dict of :func:`dcp_state_dict`'s form (filled by ``dcp.load``) into the weight
    shards and the optimizer's files (``opt.load_state_dict``: checked, then written behind a dirty
    flag). Collective: if it fails on any rank, every rank raises ``ValueError`` naming the ranks
    (restore again; a rank's files are then unchanged or dirty, never silently mixed)."""
    tables = _tables(model)
    error = None
    try:
        _load_local(tables, opt, state_dict)
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    failed = {r: e for r, e in enumerate(_everyone(next(iter(tables.values())).group, error)) if e is not None}
    if failed:
        raise ValueError("load_dcp_state_dict failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed.items()))


def _load_local(tables: dict, opt, state_dict: dict):
    index = _param_index(opt)
    state = {}
    for name, t in tables.items():
        key = f"{name}.weight" if name else "weight"
        w = _local(state_dict["model"][key])
        if w.data_ptr() != t.weight.data_ptr():
            with torch.no_grad():
                t.weight.copy_(w)
        state[index[t.weight]] = {k: _local(v) for k, v in state_dict["optim"]["state"].get(key, {}).items()}
    by_name = {(f"{n}.weight" if n else "weight"): index[t.weight] for n, t in tables.items()}
    groups = [dict(g, params=[by_name[k] for k in g["params"]]) for g in state_dict["optim"]["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


def _everyone(group, obj) -> list:
    """``obj`` of every rank of ``group``, in rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _param_index(opt) -> dict:
    """Parameter -> its index in ``opt``'s state dicts."""
    return {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
