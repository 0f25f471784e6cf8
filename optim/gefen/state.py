"""Gefen's per-parameter state: the names of its keys, in one place (state dicts, kernels and tests
use these), and the functions of its lifecycle (below the names).

Per parameter (``optimizer.state[p]``; layout and shapes in ``reference.py``'s docstring)::

    STEP    int, updates applied to this parameter (t of the bias corrections)
    BLOCK   int, block length P of the shared second moment, fixed at the first gradient
    V       fp32 (numel // P,), block-shared second moment
    SCALES  fp32 (ceil(numel / S),), first-moment scale per scale block (quantised groups)
    CODES   uint8 (numel,) at 8 bits, (ceil(numel / 2),) at 4 bits (quantised groups)
    M       fp32 (numel,), the unquantised first moment (groups with quantize_first_moment=False)
    W       fp32 (tiles * P,), per-offset factor of the second moment, one P-vector a tile of rows
            (``partition.factor_tiles``; one tile with whole_matrix_factor=True; groups with
            factor_second_moment=True, except a tensor of fewer than two dimensions in a group with
            share_vector_second_moment=True: ``holds_factor``); bf16 in groups with
            factor_dtype="bfloat16" (``factor_dtype``), rounded stochastically from SEED
    SCALE_BLOCK  int, the length S of the first moment's scale blocks where it is not the default
            (``reference.scale_block_length(BLOCK)``): factored matrices of groups with
            row_group_scales=True (``partition.row_group_scale_length``); ``scale_length`` reads either
    PROVISIONAL  bool, present (True) while every gradient so far had one magnitude everywhere: any
            block length is then exact, BLOCK is the cheapest, and it is chosen again from the
            first gradient that varies (``recut``)
    SEED    int, the seed of stochastic rounding (groups with stochastic_rounding=True, or with
            first_moment_rounding="stochastic", whose codes draw from it mixed with
            ``plan.CODE_STREAM``, or with factor_dtype="bfloat16", whose factors draw from it mixed
            with ``plan.FACTOR_STREAM``): a hash of the optimizer's ROUNDING_SEED and the parameter's index

Optimizer-wide (top-level keys of ``Gefen.state_dict()``)::

    CODEBOOK  fp32 (2**bits,) sorted, or None before the first step
    BITS      int, 8 or 4
    ROUNDING_SEED  int, the optimizer's stochastic-rounding seed (from ``torch.initial_seed()``,
            broadcast from rank 0 under torch.distributed), or None before a group rounds
"""

import math

import torch

from .partition import (MAX_BLOCK, cap_block, choose_block, constant_magnitude, factor_tiles, factored_block,
                        provisional_block, row_group_scale_length, scale_group_elements)
from .reference import num_code_bytes, num_scales, scale_block_length
from .tiling import requantize_

STEP = "step"
BLOCK = "block"
V = "v"
SCALES = "scales"
CODES = "codes"
M = "m"
W = "w"
SEED = "seed"
PROVISIONAL = "provisional"
SCALE_BLOCK = "scale_block"

CODEBOOK = "codebook"
BITS = "bits"
ROUNDING_SEED = "rounding_seed"

PER_PARAM_TENSORS = (V, SCALES, CODES, M, W)


# --------------------------------------------------------------------------------- lifecycle
# A parameter's state is created from its first non-zero gradient (``first_gradient``, ``create``),
# chosen again once from the first gradient whose magnitude varies where every earlier one had
# one magnitude (``recut``), and follows a cast of the parameter (``follow_cast``).


def state_dtype(param_dtype: torch.dtype, group) -> torch.dtype:
    """dtype of v and m: float64 for float64 parameters in a group that keeps AdamW's per-element,
    unquantised moments (so it reduces to AdamW in float64); float32 otherwise."""
    if (param_dtype == torch.float64 and not group["share_second_moment"]
            and not group["quantize_first_moment"]):
        return torch.float64
    return torch.float32


def holds_factor(group: dict, ndim: int) -> bool:
    """True where a tensor of ``ndim`` dimensions in ``group`` keeps a factor w: in a factored group,
    every tensor but a vector (fewer than two dimensions) under ``share_vector_second_moment``, which
    has no columns for the factor and steps as in an unfactored group."""
    return bool(group["factor_second_moment"]) and not (ndim < 2 and group["share_vector_second_moment"])


FACTOR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # factor_dtype -> W's dtype


def factor_dtype(group: dict) -> torch.dtype:
    """The dtype of the factors w of ``group``'s states (``factor_dtype``; fp32 where unset)."""
    return FACTOR_DTYPES[group.get("factor_dtype", "float32")]


def half_factor(group: dict) -> bool:
    """True where ``group`` keeps its factors w in bf16, rounded stochastically (``factor_dtype``)."""
    return bool(group["factor_second_moment"]) and factor_dtype(group) != torch.float32


def whole_factor(group: dict) -> bool:
    """True where ``group``'s matrices keep one column factor for the whole matrix, not one per
    square tile of rows (``whole_matrix_factor``; ``partition.factor_tiles``)."""
    return bool(group.get("whole_matrix_factor"))


def block_length(g: torch.Tensor, group: dict, block_rule: str, provisional: bool = False) -> int:
    """The block length P of a parameter's second moment, from its gradient ``g`` (local shard)."""
    return block_lengths(g, group, block_rule, provisional)[0]


def block_lengths(g: torch.Tensor, group: dict, block_rule: str, provisional: bool = False) -> tuple[int, int]:
    """(P, S): the block length P of a parameter's second moment and the length S of its first
    moment's scale blocks, from its gradient ``g`` (local shard). S is ``scale_block_length(P)``
    except for a factored matrix under ``row_group_scales`` (``partition.row_group_scale_length``)."""
    # factored, a vector keeps v per element unless share_vector_second_moment: it has no columns
    # for the factor, and blocks of a norm gain or a bias may share v between unrelated elements
    if not group["share_second_moment"] or (group["factor_second_moment"] and g.dim() < 2
                                            and not group["share_vector_second_moment"]):
        return 1, scale_block_length(1)
    block = provisional_block(g.numel()) if provisional else choose_block(g, block_rule)
    if not group["factor_second_moment"]:
        return block, scale_block_length(block)
    if g.dim() < 2:  # share_vector_second_moment: where the rule finds no block, the whole vector
        block = block if block > 1 else cap_block(g.numel())
        return block, scale_block_length(block)
    if block == 1 and group["share_matrix_rows"]:  # no block found: whole rows, times the column factor
        block = MAX_BLOCK
    block = factored_block(block, g.shape)
    return block, scale_block_length(block) if provisional else matrix_scale_length(block, g.shape, group)


def matrix_scale_length(block: int, shape, group: dict) -> int:
    """The length S of the scale blocks of a (not provisional) state of block length ``block`` for a
    tensor of ``shape`` (local shard) in ``group``: one group of whole rows of a factored matrix
    under ``row_group_scales`` (``partition.row_group_scale_length``), ``scale_block_length`` else."""
    if (group.get("row_group_scales") and group.get("factor_second_moment") and len(tuple(shape)) >= 2
            and block > 1):
        most = scale_group_elements(group["row_group_scales"])
        return row_group_scale_length(block, shape, whole_factor(group), most)
    return scale_block_length(block)


def scale_length(st: dict) -> int:
    """The length S of the scale blocks of a state with a block (``SCALE_BLOCK`` or the default)."""
    return st.get(SCALE_BLOCK) or scale_block_length(st[BLOCK])


def set_scale_length(st: dict, length: int) -> None:
    """Keep ``length`` as the state's scale-block length: ``SCALE_BLOCK`` only where it is not the
    default of its block."""
    if length == scale_block_length(st[BLOCK]):
        st.pop(SCALE_BLOCK, None)
    else:
        st[SCALE_BLOCK] = length


def first_block(g: torch.Tensor, group: dict, block_rule: str) -> tuple[int, int, bool]:
    """(block length, scale-block length, provisional) of a state created from the first non-zero
    gradient ``g``: provisional where ``g`` has one magnitude everywhere (any block length is then
    exact)."""
    provisional = group["share_second_moment"] and constant_magnitude(g)
    return (*block_lengths(g, group, block_rule, provisional), provisional)


def next_block(st: dict, g: torch.Tensor, group: dict, block_rule: str, where: str) -> int | None:
    """The scale-block length ``st`` has once a step has taken the gradient ``g`` (``first_gradient``,
    ``recut`` or the one it has), without creating or changing anything; None where that step
    creates no state (an all-zero first gradient). What a step's codebook histogram normalises by
    (``reference.scale_block_length`` of it is itself)."""
    if BLOCK not in st:
        return None if gradient_magnitude(g, where) == 0.0 else first_block(g, group, block_rule)[1]
    if st.get(PROVISIONAL) and not constant_magnitude(g):
        return block_lengths(g, group, block_rule)[1]
    return scale_length(st)


def create(st: dict, g: torch.Tensor, group: dict, *, dtype: torch.dtype, bits: int, block_rule: str,
           capturable: bool) -> None:
    """Fill ``st`` with zero moments for the gradient ``g`` (local shard): the block length chosen
    from it (``first_block``), v and m in ``dtype`` (``state_dtype``), the step kept (steps with
    all-zero gradients before this one), on the device as a float32 counter with ``capturable``
    (as torch's capturable AdamW keeps it)."""
    n, dev = g.numel(), g.device
    block, scale, provisional = first_block(g, group, block_rule)
    st[STEP] = st.get(STEP, 0)
    if capturable:
        st[STEP] = torch.tensor(float(st[STEP]), dtype=torch.float32, device=dev)
    st[BLOCK] = block
    st[V] = torch.zeros(n // block, device=dev, dtype=dtype)
    if group["quantize_first_moment"]:
        set_scale_length(st, scale)
        st[SCALES] = torch.zeros(num_scales(n, scale), device=dev, dtype=torch.float32)
        st[CODES] = torch.zeros(num_code_bytes(n, bits), dtype=torch.uint8, device=dev)
    else:
        st[M] = torch.zeros(n, device=dev, dtype=dtype)
    if holds_factor(group, g.dim()):
        st[W] = torch.zeros(len(factor_tiles(g.shape, block, whole_factor(group))) * block, device=dev,
                            dtype=factor_dtype(group))
    if provisional:
        st[PROVISIONAL] = True


def recut(st: dict, g: torch.Tensor, group: dict, *, codebook, bits: int, block_rule: str) -> None:
    """Choose the block length again from ``g``, the first gradient whose magnitude varies after
    gradients of one magnitude everywhere (``PROVISIONAL``). Until now every block mean of g**2 was
    the same, so v (and the factor w) is one value everywhere: it is kept exactly at the new length.
    The first moment is requantised once into the new scale blocks."""
    del st[PROVISIONAL]
    old, old_scale = st[BLOCK], scale_length(st)
    new, scale = block_lengths(g, group, block_rule)
    if new == old and scale == old_scale:
        return
    n = g.numel()
    st[BLOCK] = new
    if new != old:
        st[V] = refill(st[V], n // new)
        if W in st:
            st[W] = refill(st[W], len(factor_tiles(g.shape, new, whole_factor(group))) * new)
    if CODES in st:
        set_scale_length(st, scale)
        requantize_(st, codebook, n=n, old=old_scale, new=scale, bits=bits)


def first_gradient(st: dict, p: torch.Tensor, g: torch.Tensor, group: dict, *, where: str, bits: int,
                   block_rule: str, capturable: bool) -> bool:
    """Create the state ``st`` of parameter ``p`` (local shard) from its first non-zero gradient ``g``;
    True once it exists.

    An all-zero gradient (a zero-initialised layer) says nothing about blocks: it only counts the
    step and applies weight decay, which is AdamW's whole update at g = 0 with m = v = 0, so the
    state created later is AdamW's after those steps. A gradient with NaN or inf is refused
    (``gradient_magnitude``; ``where`` names the parameter).
    """
    if gradient_magnitude(g, where) == 0.0:
        st[STEP] = st.get(STEP, 0) + 1
        p.mul_(1 - float(group["lr"]) * group["weight_decay"])
        return False
    create(st, g, group, dtype=state_dtype(p.dtype, group), bits=bits, block_rule=block_rule,
           capturable=capturable)
    return True


def gradient_magnitude(g: torch.Tensor, where: str) -> float:
    """|min| + |max| of a first gradient: 0 exactly when it is all zeros. A gradient with NaN or inf
    is refused (``where`` names the parameter): blocks and codebook would be chosen from it for good."""
    lo, hi = g.detach().aminmax()  # NaN if any is NaN; no copy of g
    amax = abs(float(lo)) + abs(float(hi))  # inf or NaN when an element is
    if not math.isfinite(amax):
        raise ValueError(
            f"Gefen: the first gradient of {where} contains NaN or inf; its block length and the "
            "codebook are chosen from it: skip this step (as torch.amp.GradScaler does) or fix the loss")
    return amax


def follow_cast(st: dict, want: torch.dtype) -> bool:
    """Moments kept in the parameter's precision (``want``, ``state_dtype``: float64 for
    AdamW's reduction of a float64 parameter) follow a cast of the parameter made after they were
    created (``model.float()``, ``model.double()``), as a state dict loaded after the cast would be.
    True if they were cast."""
    if st[V].dtype == want or st[V].dtype not in (torch.float32, torch.float64):  # others: refused
        return False
    for key in (V, M):
        if key in st:
            st[key] = st[key].to(want)
    return True


def refill(t: torch.Tensor, size: int) -> torch.Tensor:
    """A tensor of ``size`` elements holding ``t``'s one value (its mean where its values differ)."""
    value = t[0] if bool((t == t[0]).all()) else t.mean()
    return value.expand(size).clone()


def restored(st: dict, device: torch.device, *, capturable: bool) -> dict:
    """A checked saved state as a parameter's on ``device``: its tensors as they were (not cast to
    the parameter's dtype as torch's restore does: bf16 would round v and scales, uint8 codes would
    become floats), as contiguous copies; the step an int, or with ``capturable`` a float32 counter
    on the device once the parameter has state."""
    st = {k: (v.detach().to(device).clone(memory_format=torch.contiguous_format)
              if torch.is_tensor(v) else v) for k, v in st.items()}
    if capturable and BLOCK in st:
        st[STEP] = torch.tensor(float(st[STEP]), dtype=torch.float32, device=device)
    return st
