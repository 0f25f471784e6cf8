"""Gefen under ``torch.distributed``: DTensor shards, one codebook for all ranks, sharded checkpoints.

DDP needs nothing here to train: its gradients are averaged before ``step()``, every rank holds
the same parameters, so every rank chooses the same blocks and learns the same codebook. Its
checkpoints use the distributed form below.

FSDP2 (``torch.distributed.fsdp.fully_shard``) makes every parameter a DTensor sharded on dim 0.
Gefen keeps each tensor's state with its local shard (``p.to_local()``) and chooses its block
length P from the local shard's first gradient, so P may differ between ranks. Two things need
the group:

* The codebook is learned from the histogram of block-normalised gradients *summed over all
  ranks* (:func:`global_histogram`), so every rank holds the same codebook.
* Checkpoints. ``torch.distributed.checkpoint`` (DCP) saves a DTensor shard by shard and reloads it
  into any other sharding, but needs tensors whose global shape does not depend on the sharding
  or on P, because a fresh optimizer (``get_optimizer_state_dict`` first runs a zero-gradient step
  on it, which picks other blocks) must present tensors of the saved shapes. So wherever
  torch.distributed is in use (a DTensor parameter or an initialised process group, DDP
  included), ``Gefen.state_dict()`` returns the *distributed form* (:func:`to_distributed`); for
  a parameter of shape ``shape`` (DTensors placed like the parameter, plain tensors otherwise)::

      v       fp32 ``shape``: v of the element's block
      scales  fp32 ``shape``: scale of the element's scale block (of S elements: ``state.scale_length``)
              (quantised groups)
      codes   uint8 ``shape``: the element's code (4-bit codes one a byte)   (quantised groups)
      m       fp32 ``shape``: the first moment   (groups with quantize_first_moment=False)
      w       fp32 ``shape``: the factor w of the element's offset in its block, from its
              shard's w of its tile (``partition.factor_tiles``, one a local shard under
              ``whole_matrix_factor``; a bf16 w is written exactly, and loads as its group's
              ``factor_dtype``)   (states with a factor: ``state.holds_factor``)
      layout  int64 (rows, 4), the same on every rank: per row of dim 0, the saved block length
              P, the row's first element's position in its v-block and in its scale block, and
              the step count
      codebook  fp32 (2**bits,), the same on every rank, zeros before the first step
              (``get_optimizer_state_dict`` keeps only per-parameter state, so the model-wide
              codebook travels with each parameter of a quantised group)
      seed, provisional  ints: the stochastic-rounding seed (-1: none) and 1 while the block
              length is provisional (``state.py``); in every entry, a fresh one's included
      rounding_seed  int, the same in every entry: the optimizer's stochastic-rounding seed (-1:
              none), which ``get_optimizer_state_dict`` would drop at the top level

  That is 9 bytes per element in the checkpoint (8 with an unquantised first moment; 4 more with
  a factored second moment) against about 1 in memory: the price of a checkpoint that reshards
  freely.

Loading (:func:`from_distributed`) cuts each rank's local rows back into Gefen's compact state.
Onto another number of ranks this is exact where every new local shard starts and ends on a
saved block boundary and sees one block length; otherwise it raises a ``ValueError`` that names
the parameter and says what to do. Tensors saved with P = 1 (per-element v) on every rank always
fit. A loaded scale block whose saved elements all hold one scale takes it and their codes (the
first moment exactly as saved); where one holds several (P = 1 tensors whose 256-element chunks
moved, row-group scales, ``row_group_scales``, whose groups a new shard cuts elsewhere), the first
moment is requantised once with the codebook (one more rounding of m, at most half a codebook gap
times the scale; v untouched).
A factored second moment's w is per tile of a local shard (the mean over its blocks; tiles,
``partition.factor_tiles``, cut the local shard's rows, or are the local shard): a loaded tile's w is the mean of the
saved w over its elements at each offset, i.e. the saved shard's w where the
sharding is unchanged (exactly), the block-weighted mean of the saved shards' w where shards merge
(the w one process would hold up to rounding), the saved shard's w where a shard splits.

Not supported: ``StateDictOptions(flatten_optimizer_state_dict=True)`` (loading raises, saying so).
Supported placements: ``Shard(0)`` on at most one mesh dimension and ``Replicate`` elsewhere
(FSDP2, HSDP). Other shardings (tensor parallel ``Shard(1)``, strided shards) raise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._torch_private import is_dcp_init_step, local_shape_and_offset
from . import state as K
from .partition import tile_elements
from .reference import num_code_bytes, num_scales, pack_codes, quantize, scale_block_length, unpack_codes

LAYOUT = "layout"
_BLOCK, _POS_V, _POS_S, _STEP = range(4)


# ------------------------------------------------------------------------------- DTensor access
def is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def local_shard(t):
    """The local shard of a DTensor (state lives with it), the tensor itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


def is_sharded(p) -> bool:
    """True for a DTensor with a ``Shard`` placement (its local shards differ between ranks)."""
    return is_dtensor(p) and any(pl.is_shard() for pl in p.placements)


def _check_placements(p, what: str = "parameter"):
    shards = [pl for pl in p.placements if pl.is_shard()]
    bad = [pl for pl in p.placements if not (pl.is_shard() or pl.is_replicate())]
    if bad or len(shards) > 1 or (shards and shards[0].dim != 0) or (shards and p.dim() == 0):
        raise ValueError(
            f"Gefen: {what} of shape {tuple(p.shape)} has placements {tuple(p.placements)}; Gefen's "
            "distributed state supports Shard(0) on one mesh dimension and Replicate elsewhere "
            "(FSDP2 / HSDP); shard other dimensions (e.g. tensor parallelism) outside Gefen")


def shard_rows(p):
    """(first row, end row, rows, row length) of a parameter's local shard along dim 0.

    A 0-dim or replicated parameter is one shard of all its rows. Local shards of ``Shard(0)``
    parameters are contiguous runs of rows, hence contiguous ranges of the flattened tensor.
    """
    rows = p.shape[0] if p.dim() > 0 else 1
    row_len = p.numel() // rows if rows else 0
    if not is_sharded(p):
        return 0, rows, rows, row_len
    _check_placements(p)
    shape, offset = local_shape_and_offset(p)
    return offset[0], offset[0] + shape[0], rows, row_len


def _shard_groups(p):
    """Process groups of the mesh dimensions over which p is sharded."""
    return [p.device_mesh.get_group(d) for d, pl in enumerate(p.placements) if pl.is_shard()]


# ----------------------------------------------------------------------------------- codebook
def joins_codebook(params) -> bool:
    """True if this rank must take part in the codebook all-reduce (some parameter is sharded),
    even when none of its local shards holds elements."""
    return any(is_sharded(p) for p in params)


def latest_step(step: int, params=()) -> int:
    """The largest of every rank's ``step`` where ``params`` hold a sharded parameter (a rank whose
    local shards are all empty holds no state, hence no step count, and must still agree on the
    codebook's refresh steps); ``step`` itself otherwise. Collective in the first case."""
    sharded = [p for p in params if is_sharded(p)]
    if not sharded:
        return step
    out = torch.tensor([step], dtype=torch.int64, device=local_shard(sharded[0]).device)
    for group in _shard_groups(sharded[0]):
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return int(out.item())


def global_histogram(hist_fn, grads: dict, params=()) -> torch.Tensor:
    """Codebook histogram over the whole model, the same on every rank.

    ``grads`` maps parameters to their local gradients; ``hist_fn(grads) -> int64 counts`` (it
    must accept an empty dict). Counts of sharded parameters are summed over their shard groups
    (each rank holds a different part of them); counts of plain or replicated parameters (DDP)
    are taken once, since every rank holds the same ones. Collective whenever ``grads`` or
    ``params`` (all parameters that may have gradients) hold a sharded parameter, so a rank
    whose local shards are all empty still joins.
    """
    sharded = {p: g for p, g in grads.items() if is_sharded(p)}
    plain = {p: g for p, g in grads.items() if not is_sharded(p)}
    mesh_params = list(sharded) or [p for p in params if is_sharded(p)]
    if not mesh_params:
        return hist_fn(plain)
    keys = {tuple(id(g) for g in _shard_groups(p)) for p in mesh_params}
    if len(keys) > 1:
        raise ValueError("Gefen: sharded parameters live on different device meshes or "
                         "placements; use one Gefen optimizer per mesh")
    # on the parameters' device: NCCL reduces CUDA tensors only
    part = hist_fn(sharded).to(torch.int64).to(local_shard(mesh_params[0]).device)
    for group in _shard_groups(mesh_params[0]):
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
    part = part.cpu()
    return part + hist_fn(plain).cpu() if plain else part


def shared_seed(seed: int) -> int:
    """``seed`` from rank 0 where a process group is initialised (collective: every rank calls it
    at the same step), ``seed`` itself otherwise: replicas must round alike."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [seed]
        dist.broadcast_object_list(box, src=0)
        return int(box[0])
    return seed


def is_state_dict_init_step(opt) -> bool:
    """True for the zero-gradient, lr = 0 step that ``torch.distributed.checkpoint.state_dict``
    runs on an optimizer without state (``_init_optim_state``) to make it create its state.

    Gefen must not take it: it would choose every block from zero gradients (P = 1) and learn
    its codebook from an all-zero histogram, for good. Gefen's distributed state dict needs no
    such step (it presents zeros of the saved shapes), so the step is skipped.
    """
    return is_dcp_init_step(opt, lambda g: not bool(local_shard(g).any()))


# --------------------------------------------------------------------------------- checkpoints
def _dtensor_like(p, local: torch.Tensor):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.reshape(local_shard(p).shape), p.device_mesh, p.placements,
                              run_check=False, shape=p.shape, stride=p.stride())


def _local_layout(st, r0, r1, row_len):
    """This rank's rows of the layout table (see the module docstring)."""
    rows = torch.zeros(r1 - r0, 4, dtype=torch.int64)
    if st is None or r1 == r0:
        return rows
    block = int(st[K.BLOCK])
    start = torch.arange(r1 - r0, dtype=torch.int64) * row_len
    rows[:, _BLOCK] = block
    rows[:, _POS_V] = start % block
    rows[:, _POS_S] = start % K.scale_length(st)
    rows[:, _STEP] = int(st[K.STEP])
    return rows


def _full_layout(p, local_rows):
    if not is_sharded(p):
        return local_rows
    local_rows = local_rows.to(local_shard(p).device)  # NCCL gathers CUDA tensors only
    return _dtensor_like_rows(p, local_rows, p.shape[0]).full_tensor().cpu()


def _dtensor_like_rows(p, local_rows, rows):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_rows, p.device_mesh, p.placements, run_check=False,
                              shape=(rows, 4), stride=(4, 1))


def to_distributed(state: dict, params, ids, quantized, *, codebook, bits: int, factored=None, whole=None) -> None:
    """Rewrite ``state`` (``Optimizer.state_dict()['state']``) in place into the distributed form.

    ``quantized[i]`` is the ``quantize_first_moment`` flag of the group of ``params[i]``,
    ``factored[i]`` whether its state holds a factor w (``state.holds_factor``; None: all False),
    ``whole[i]`` whether that factor is one a matrix (``state.whole_factor``; None: all False).
    Every parameter gets the sharding- and block-independent form of the module docstring (plain
    parameters, as under DDP, as one shard of all their rows: a fresh optimizer's blocks differ
    from the saved ones, so DCP needs shapes that do not depend on them), with a copy of the
    codebook. Collective over the sharded parameters' meshes: every rank must call it with the
    same parameters (``get_optimizer_state_dict`` does).
    """
    factored = factored or [False] * len(params)
    whole = whole or [False] * len(params)
    for pid, p, quant, fac, one in zip(ids, params, quantized, factored, whole):
        if not p.requires_grad:
            continue
        st = _to_distributed_one(p, state.get(pid), quantized=quant, bits=bits, factored=fac, whole=one)
        if quant:  # all zeros before the first step (a learned codebook ends at -1 and +1)
            st[K.CODEBOOK] = torch.zeros(2**bits, dtype=torch.float32) if codebook is None else codebook.detach().clone()
        state[pid] = st


def _to_distributed_one(p, st, *, quantized, bits, factored=False, whole=False):
    r0, r1, rows, row_len = shard_rows(p)
    layout = _full_layout(p, _local_layout(st, r0, r1, row_len))
    n = local_shard(p).numel()
    out = {K.STEP: int(layout[:, _STEP].max()), LAYOUT: layout}
    if st is None:
        # No state here yet (a fresh optimizer, or an empty local shard): zeros of the same
        # shapes, block 0 in the layout meaning "no state", so that a fresh optimizer presents DCP
        # with every tensor a checkpoint holds, whatever blocks it will choose itself.
        st = {K.BLOCK: 1, K.V: torch.zeros(n, dtype=torch.float32)}
        if quantized:
            st[K.SCALES] = torch.zeros(num_scales(n, 1), dtype=torch.float32)
            st[K.CODES] = torch.zeros(num_code_bytes(n, bits), dtype=torch.uint8)
        else:
            st[K.M] = torch.zeros(n, dtype=torch.float32)
        if factored:
            st[K.W] = torch.zeros(1, dtype=torch.float32)
    # always both keys (a template made before any step included), so torch.distributed.checkpoint
    # finds in a fresh optimizer every key a checkpoint holds: -1 is no seed, 0 not provisional
    out[K.SEED] = int(st.get(K.SEED, -1))
    out[K.PROVISIONAL] = int(bool(st.get(K.PROVISIONAL, False)))
    block = int(st[K.BLOCK])
    dev = local_shard(p).device
    like = (lambda t: _dtensor_like(p, t)) if is_sharded(p) else (lambda t: t.reshape(p.shape))
    out[K.V] = like(st[K.V].to(dev).float().repeat_interleave(block))
    if K.W in st:
        out[K.W] = like(_factor_of_elements(st[K.W].to(dev).float(), local_shard(p).shape, block, whole))
    if K.M in st:
        out[K.M] = like(st[K.M].to(dev).float())
    else:
        out[K.SCALES] = like(st[K.SCALES].to(dev).float().repeat_interleave(K.scale_length(st))[:n])
        out[K.CODES] = like(unpack_codes(st[K.CODES], n, bits).to(torch.uint8))
    return out


def check_reshard(layout: torch.Tensor, r0: int, r1: int, row_len: int, *, name: str = "parameter") -> int:
    """The one saved block length of rows ``[r0, r1)`` of a saved layout. Raises ``ValueError`` if
    the rows cannot hold Gefen's state exactly: they see several block lengths, or the shard
    starts or ends inside a saved block."""
    rows = layout.shape[0]
    if r1 <= r0:
        return 1
    part = layout[r0:r1]
    blocks = sorted(set(part[:, _BLOCK].tolist()))
    why = None
    if len(blocks) != 1 or blocks[0] < 1:
        why = f"its rows were saved with different block lengths {blocks}"
    else:
        block = blocks[0]
        expect = torch.arange(r1 - r0, dtype=torch.int64) * row_len
        n = (r1 - r0) * row_len
        if n % block or not torch.equal(part[:, _POS_V], expect % block) or \
                (r1 < rows and int(layout[r1, _POS_V]) != 0):
            why = f"the shard does not start and end on boundaries of the saved blocks of length {block}"
    if why:
        raise ValueError(
            f"Gefen: cannot load the checkpointed state of {name} into this sharding (rows "
            f"{r0}..{r1} of {rows}, {row_len} elements a row): {why}. Gefen chose its blocks per "
            "local shard when the checkpoint was written; load it onto the number of ranks it was "
            "saved from, or onto one where every rank's shard is a whole number of the saved blocks")
    return block


def from_distributed(sd: dict, params, ids, *, bits: int, groups=None) -> dict:
    """The inverse of :func:`to_distributed` for this rank's sharding: a new state dict whose
    per-parameter state is Gefen's compact local form, with the codebook at the top level.
    ``groups[i]``: the param group of ``params[i]``, whose layout options (the factor's tiles, the
    scale blocks) the loaded state takes (None: the defaults)."""
    sd = dict(sd)
    state = dict(sd.get("state", {}))
    codebook = sd.get(K.CODEBOOK)
    for st in state.values():
        if codebook is None and isinstance(st, dict) and st.get(K.CODEBOOK) is not None:
            codebook = st[K.CODEBOOK]
    if codebook is not None:
        codebook = local_shard(codebook).detach().float().cpu()
    if sd.get(K.ROUNDING_SEED) is None:  # a DCP load: the seed of every entry
        seeds = [int(st[K.ROUNDING_SEED]) for st in state.values()
                 if isinstance(st, dict) and st.get(K.ROUNDING_SEED) is not None]
        if seeds and seeds[0] >= 0:
            sd[K.ROUNDING_SEED] = seeds[0]
    if codebook is not None and not bool(codebook.any()):
        codebook = None  # the placeholder of an optimizer that had not stepped
    if codebook is not None:
        if codebook.numel() != 2**bits:
            raise ValueError(f"Gefen: the checkpoint's codebook has {codebook.numel()} entries, this "
                             f"optimizer has bits={bits} ({2**bits}); construct Gefen with the bits it "
                             "was saved with")
    for k, (pid, p) in enumerate(zip(ids, params)):
        st = state.get(pid)
        if not isinstance(st, dict):
            continue
        if any(isinstance(st.get(key), dict) for key in (K.BLOCK, K.STEP)):
            # torch's unflattening rebuilds only the keys of the live state, as empty dicts
            raise ValueError(
                "Gefen: optimizer state dicts made with StateDictOptions("
                "flatten_optimizer_state_dict=True) lose Gefen's layout and codebook (torch "
                "rebuilds only the keys of the live state); save and load Gefen with the default "
                "nested optimizer state dict (flatten_optimizer_state_dict=False)")
        st = {key: val for key, val in st.items() if key not in (K.CODEBOOK, K.ROUNDING_SEED)}
        if LAYOUT in st:
            name = pid if isinstance(pid, str) else f"parameter {k}"
            st = _from_distributed_one(p, st, codebook=codebook, bits=bits, name=name,
                                       group=None if groups is None else groups[k])
        if st is None:
            state.pop(pid)  # saved before its first gradient: it chooses its blocks at that one
        else:
            state[pid] = st
    sd["state"] = state
    sd[K.CODEBOOK] = codebook
    return sd


def _factor_of_elements(w, shape, block, whole=False):
    """The factor w of each element's offset in its block, from its tile's w (``block`` floats a
    tile; ``whole`` as ``partition.factor_tiles``'s)."""
    return torch.cat([w[k * block:(k + 1) * block].repeat((b - a) // block)
                      for k, (a, b) in enumerate(tile_elements(shape, block, whole))])


def _local_rows_of(t, p, r0, r1):
    """This rank's rows of a loaded distributed-form tensor, flattened (DTensor or full tensor)."""
    if is_dtensor(t):
        t = t.to_local()
    elif t.dim() > 0 and tuple(t.shape) == tuple(p.shape) and (r1 - r0) != (p.shape[0] if p.dim() else 1):
        t = t[r0:r1]  # a full (gathered) tensor: cut out this rank's rows
    return t.reshape(-1)


def _factor_dtype(group) -> torch.dtype:
    """The dtype a loaded factor w takes: its group's (``state.factor_dtype``), fp32 without one."""
    return torch.float32 if group is None else K.factor_dtype(group)


def _from_distributed_one(p, st, *, codebook, bits, name, group=None):
    r0, r1, rows, row_len = shard_rows(p)
    layout = local_shard(st[LAYOUT]).cpu().to(torch.int64)
    if tuple(layout.shape) != (rows, 4):
        raise ValueError(f"Gefen: the checkpointed layout of {name} has shape {tuple(layout.shape)}, "
                         f"expected ({rows}, 4); the checkpoint comes from a model with other shapes")
    mine = layout[r0:r1, _BLOCK] if r1 > r0 else layout[:, _BLOCK]
    if not bool((mine > 0).any()):
        return None  # no state was saved for these rows
    if not bool((mine > 0).all()):
        raise ValueError(f"Gefen: the checkpoint holds state for only some rows {r0}..{r1} of {name}; "
                         "load it onto the number of ranks it was saved from")
    block = check_reshard(layout, r0, r1, row_len, name=name)
    dev = local_shard(p).device
    shape = local_shard(p).shape
    out = {K.STEP: int(st[K.STEP]), K.BLOCK: block}
    if int(st.get(K.SEED, -1)) >= 0:
        out[K.SEED] = int(st[K.SEED])
    provisional = bool(int(st.get(K.PROVISIONAL, 0)))
    if provisional:
        out[K.PROVISIONAL] = True
    out[K.V] = _local_rows_of(st[K.V], p, r0, r1)[::block].float().to(dev).clone()
    if K.W in st:  # per tile, the mean over its blocks in float64: exact where they hold the same w
        w = _local_rows_of(st[K.W], p, r0, r1).double()
        whole = group is not None and K.whole_factor(group)
        out[K.W] = torch.cat([w[a:b].view(-1, block).mean(dim=0)
                              for a, b in tile_elements(shape, block, whole)]).to(dev, _factor_dtype(group))
    if K.M in st:
        out[K.M] = _local_rows_of(st[K.M], p, r0, r1).float().to(dev).clone()
        return out
    s_len = (scale_block_length(block) if provisional or group is None
             else K.matrix_scale_length(block, shape, group))
    K.set_scale_length(out, s_len)
    codes = _local_rows_of(st[K.CODES], p, r0, r1).to(torch.int64)
    scales = _local_rows_of(st[K.SCALES], p, r0, r1).float()
    first = scales[::s_len]
    if torch.equal(first.repeat_interleave(s_len)[:scales.numel()], scales):
        # every new scale block holds one saved scale: its codes as saved, m exactly
        out[K.SCALES] = first.to(dev).clone()
        out[K.CODES] = pack_codes(codes, bits).to(dev)
        return out
    if codebook is None:
        raise ValueError(f"Gefen: the checkpoint has no codebook for {name}")
    cb = codebook.to(scales.device)  # the saved scale blocks cut by the new ones: requantise m once
    new_scales, new_codes = quantize(cb[codes] * scales, cb, block=s_len, bits=bits)
    out[K.SCALES] = new_scales.to(dev)
    out[K.CODES] = new_codes.to(dev)
    return out


# ------------------------------------------------------------------- hooks for Gefen.state_dict
def _uses_distributed_form(params) -> bool:
    return any(is_dtensor(p) for p in params) or (dist.is_available() and dist.is_initialized())


def _params_and_ids(opt, sd):
    params = [p for g in opt.param_groups for p in g["params"]]
    quantized = [bool(g["quantize_first_moment"]) for g in opt.param_groups for _ in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    return params, ids, quantized


def _factored(opt):
    """Per parameter, whether its state holds a factor w (``state.holds_factor``: not a vector under
    share_vector_second_moment), so that a fresh optimizer's template has the checkpoint's keys."""
    return [K.holds_factor(g, p.dim()) for g in opt.param_groups for p in g["params"]]


def to_distributed_state_dict(opt, sd: dict) -> dict:
    """``Gefen.state_dict()`` hook: the distributed form where torch.distributed is in use (a
    DTensor parameter, or an initialised process group), ``sd`` unchanged otherwise. With
    sharded parameters it is collective: call ``state_dict()`` on every rank, as
    ``get_optimizer_state_dict`` does."""
    params, ids, quantized = _params_and_ids(opt, sd)
    if _uses_distributed_form(params):
        sd["state"] = dict(sd["state"])
        to_distributed(sd["state"], params, ids, quantized, codebook=opt.codebook, bits=opt.bits,
                       factored=_factored(opt), whole=[K.whole_factor(g) for g in opt.param_groups for _ in g["params"]])
        # get_optimizer_state_dict keeps only "state" and "param_groups": the optimizer's rounding
        # seed travels in every entry too (-1: none), as the codebook does
        seed = sd.get(K.ROUNDING_SEED)
        for st in sd["state"].values():
            st[K.ROUNDING_SEED] = -1 if seed is None else int(seed)
    return sd


def from_distributed_state_dict(opt, sd: dict) -> dict:
    """``Gefen.load_state_dict()`` hook: compact local state for this rank's shards."""
    if "param_groups" not in sd:
        return sd
    params, ids, _ = _params_and_ids(opt, sd)
    if len(ids) != len(params):
        return sd  # Gefen.load_state_dict reports the mismatch
    # the saved groups' options: load_state_dict makes them the live groups' (a distributed-form
    # checkpoint whose groups were edited loads into the edited layout)
    return from_distributed(sd, params, ids, bits=opt.bits, groups=[g for g in sd["param_groups"] for _ in g["params"]])
