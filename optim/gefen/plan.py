"""Gefen's step plan: what a step derives from the set of tensors, built once and reused.

A plan holds, for the parameters that have a gradient, one ``Call`` per kernel call (a bucket of
tensors sharing group, block length, step, device, state dtype, path and whether their state holds
a factor w) and in each the ``Tile`` records the kernels step: a parameter, or with a factored
second moment one tile of its rows (``partition.factor_tiles``), with views of its state. A step
hands a backend a call's ``Tile`` records, their gradients and a ``Hyper`` record of the call's
hyper-parameters (``run_call``). A later step only reads each parameter's gradient and advances
its step count; the backends keep their own launch tables for a call (``numba_ops.prepare``,
``triton_ops``' plan cache). With ``capturable`` the step counts are
device tensors that a kernel advances (``triton_ops.StepScalars``, one a group and device, whose
rows each call's tiles read: ``Call.rows``), and a call is not split by step.

The plan is keyed by ``signature``: per group its structural options, per parameter whether it
has a gradient, the Parameter object itself (its ``id``), the address of its data's first element
(storage offset included), its strides, shape, dtype and device, and its gradient's dtype, shape
and layout. Anything that changes those (a Parameter re-wrapped and put back into the group,
``p.data`` replaced, resized, transposed or re-strided, a move or cast, a gradient that appears,
disappears or changes dtype or layout, an option edited in place) gives another key and a new
plan; what the key cannot see (state created, re-cut or loaded, a new codebook, a new group)
drops the plans explicitly (``Gefen._drop_plans``). A plan holds the Parameters it steps, so no
other object takes the ``id`` of one while the plan lives.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import NamedTuple

import torch

from .._base import local_tensor
from .._rounding import STOCHASTIC_DTYPES, hash32_int, step_seed
from . import numba_ops, state as K
from .partition import factor_tiles, tile_elements
from .reference import moment_bound

# Options that change which tensors a call holds or how they are stepped; lr, betas, eps and
# weight_decay are read from the group at every step.
STRUCTURAL = ("share_second_moment", "quantize_first_moment", "factor_second_moment", "share_vector_second_moment",
              "stochastic_rounding", "first_moment_rounding", "row_group_scales",
              "whole_matrix_factor", "factor_dtype", "maximize")
# Mixed into a parameter's seed (``state.SEED``) for the words of its codes' stochastic rounding, so
# that they are not the words its bf16 or fp16 weights are rounded with (murmur3's second constant),
# and for those of its bf16 factor w (the third).
CODE_STREAM = 0x85EBCA6B
FACTOR_STREAM = 0xC2B2AE35


class Tile(NamedTuple):
    """One tensor a kernel steps: a parameter (local shard), or a tile of its rows, with views of its
    state; the record each backend's ``gefen_step_`` reads by name. ``Tile(p, v, scales, first, w)``
    is a whole tensor of its own (what the kernel tests build)."""

    p: torch.Tensor  # the parameter, or the view of the tile's rows
    v: torch.Tensor  # fp32 second moment, one a v block
    scales: torch.Tensor | None  # quantised first moment: fp32 scale per scale block; None unquantised
    first: torch.Tensor  # uint8 codes, or the fp32 first moment m when unquantised
    w: torch.Tensor | None = None  # the tile's factor (factored calls); None otherwise
    owner: int = 0  # index of its parameter in ``Call.params``
    rows: tuple | None = None  # (r0, r1): the rows of a tile of several; None for a whole tensor
    start: int = 0  # its first element in the parameter
    tile: int | None = None  # k of ``step_seed(seed, k, 0)`` for a tile of several; None for a whole tensor


class Hyper(NamedTuple):
    """The hyper-parameters of one call at one step, the record each backend's ``gefen_step_``
    reads by name (step None: on the device, ``Call.rows``; lr then may be a device tensor)."""

    step: int | None
    lr: float | torch.Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bound: float = math.inf  # clip of m^ to bound * sqrt(u) (reference.moment_bound, own_moment_cap); inf: none


class Call:
    """One backend call of a step: parameters of one group sharing block length, step (unless the
    steps are on the device), device, state dtype, path, factor (``factored``) and scale-block
    length, and their tiles. ``scale``: that length where it is not the default of the block
    (``state.SCALE_BLOCK``: the torch step's ``scale``), else None. ``native`` is what the backend
    prepared for it once; ``rows`` each tile's row of step scalars on the device (capturable),
    None where the host passes them, and ``factor_rows`` each tile's step seed of its bf16 factor
    there (None without one)."""

    __slots__ = ("group", "path", "block", "scale", "params", "states", "tiles", "native", "held", "rows",
                 "factor_rows", "written")

    def __init__(self, group, path, block, params, states, tiles):
        self.group, self.path, self.block = group, path, block
        self.scale = states[0].get(K.SCALE_BLOCK)
        self.params, self.states, self.tiles = params, states, tiles
        self.native = None
        self.held = [_held(st) for st in states]
        self.rows = self.factor_rows = None
        self.written = [t.p for t in tiles]  # what a compiled kernel writes through addresses (``written``)

    def current(self) -> bool:
        """True while every parameter of the call is at one step and holds the state tensors the
        call was built on (parameters stepped apart, e.g. under ``step_in_backward``, or state
        replaced through ``optimizer.state``, make the step build a new plan and check them). Step
        counters on the device are compared by identity only: each is read where it lives."""
        step = self.states[0][K.STEP]
        on_device = torch.is_tensor(step)
        for st, h in zip(self.states, self.held):
            if (not on_device and st[K.STEP] != step) or _held(st) != h:
                return False
        return True

    def hyper(self, step: int | None) -> Hyper:
        """The call's hyper-parameters at ``step``; None: the step and lr are read on the device, so
        a tensor lr stays a tensor (``float`` would wait for the device)."""
        g = self.group
        beta1, beta2 = g["betas"]
        bound = moment_bound(beta1, beta2) if g["bound_first_moment"] else math.inf
        return Hyper(step, g["lr"] if step is None else float(g["lr"]), beta1, beta2, g["eps"], g["weight_decay"],
                     bound)

    @property
    def factored(self) -> bool:
        """True where the call's states hold a factor w (``state.holds_factor``): its tiles step
        factored; a vector without w in a factored group steps as in an unfactored one."""
        return K.W in self.states[0]

    @property
    def sr(self) -> bool:
        """True where the call's parameters are written with stochastic rounding (seeds drawn)."""
        return bool(self.group["stochastic_rounding"]) and K.SEED in self.states[0]

    @property
    def code_sr(self) -> bool:
        """True where the call's first-moment codes are rounded stochastically (seeds drawn)."""
        return rounds_codes(self.group) and K.SEED in self.states[0]

    @property
    def factor_sr(self) -> bool:
        """True where the call's factors w are bf16, rounded stochastically (seeds drawn)."""
        return self.factored and self.states[0][K.W].dtype != torch.float32 and K.SEED in self.states[0]

    def gradients(self, grads) -> list:
        """Each tile's gradient: the parameter's, or the view of the tile's elements."""
        out = []
        for t in self.tiles:
            g = grads[t.owner]
            out.append(g if t.rows is None else g[t.rows[0]:t.rows[1]])
        return out

    def seeds(self, step: int, stream: str = "weights") -> list | None:
        """Each tile's stochastic-rounding seed at ``step`` (``optim._rounding``) for ``stream``: its
        weights, its first moment's "codes" or its "factor" w (the parameter's seed mixed with
        ``CODE_STREAM`` or ``FACTOR_STREAM`` first); None where the call does not round those
        stochastically."""
        if not getattr(self, _STREAMS[stream][0]):
            return None
        per = [step_seed(stream_seed(st[K.SEED], stream), 0, step) for st in self.states]
        return [per[t.owner] if t.tile is None else step_seed(per[t.owner], t.tile, 0) for t in self.tiles]


def stream_seed(seed: int, stream: str) -> int:
    """A parameter's seed for ``stream`` ("weights", "codes" or "factor"), the base its step seeds derive
    from: the seed itself for the weights, mixed with the stream's constant otherwise."""
    mix = _STREAMS[stream][1]
    return hash32_int(seed ^ mix) if mix else seed


def rounds_codes(group) -> bool:
    """True where ``group`` rounds its first moment's codes stochastically."""
    return group["first_moment_rounding"] == "stochastic" and bool(group["quantize_first_moment"])


# a seeds stream -> (the ``Call`` property that says the call rounds it, the constant mixed into the seed)
_STREAMS = {"weights": ("sr", 0), "codes": ("code_sr", CODE_STREAM), "factor": ("factor_sr", FACTOR_STREAM)}


def seeded(group) -> bool:
    """True where ``group`` rounds something stochastically, so that its parameters need seeds."""
    return bool(group["stochastic_rounding"]) or every_parameter_seeded(group)


def every_parameter_seeded(group) -> bool:
    """True where every parameter of ``group`` needs a seed, fp32 ones too: its codes or its
    factors are rounded stochastically (``draw_seeds``' ``every``)."""
    return rounds_codes(group) or K.half_factor(group)


def _held(st) -> tuple:
    """Identities of a parameter's state tensors, its step counter among them where that is a
    tensor (the call holds them: no id is reused meanwhile)."""
    get = st.get
    step = get(K.STEP)
    return (id(get(K.V)), id(get(K.SCALES)), id(get(K.CODES)), id(get(K.M)), id(get(K.W)),
            id(step) if torch.is_tensor(step) else None)


def signature(groups, local) -> tuple:
    """The key of the plan for ``groups`` as they are now (module docstring). ``local``: the
    local shard of a tensor (DTensor) or the tensor."""
    sig = []
    add = sig.append
    for group in groups:
        add(tuple(group[k] for k in STRUCTURAL))
        for p in group["params"]:
            g = p.grad
            if g is None:
                add(None)
                continue
            x = local(p)
            add((id(p), x.data_ptr(), x.stride(), x.shape, x.dtype, x.device, g.dtype, g.shape, g.layout,
                 g.is_contiguous()))
    return tuple(sig)


def tiles_of(owner: int, p: torch.Tensor, st: dict, *, bits: int) -> list:
    """The ``Tile`` s of one parameter (local tensor ``p``, state ``st``): the whole tensor, or with
    a factored second moment of several tiles one per tile, views of its rows and of their state,
    each with its own w, so that every backend steps a tile as a tensor of its own."""
    block, w = st[K.BLOCK], st.get(K.W)
    quant, scale = K.CODES in st, K.scale_length(st)
    first = st[K.CODES] if quant else st[K.M]
    if w is None or w.numel() == block:
        return [Tile(p, st[K.V], st.get(K.SCALES), first, w, owner=owner)]
    v, scales = st[K.V], st.get(K.SCALES)
    return [Tile(p[r0:r1], v[a // block:b // block], None if scales is None else scales[a // scale:b // scale],
                 first[c0:c1] if quant else first[a:b], w[k * block:(k + 1) * block], owner=owner, rows=(r0, r1),
                 start=a, tile=k)
            for k, (r0, r1, a, b, c0, c1) in enumerate(tile_plan(tuple(p.shape), block, bits))]


@functools.lru_cache(maxsize=1024)
def tile_plan(shape: tuple, block: int, bits: int) -> tuple:
    """Per tile (rows r0:r1, elements a:b, code bytes c0:c1): P divides the row, so v and scales
    split at a / P (scales at a / S, which divides a tile: ``partition.row_group_scale_length``); 4-bit
    codes at a / 2 (a is even)."""
    return tuple((r0, r1, a, b, *((a // 2, -(-b // 2)) if bits == 4 else (a, b)))
                 for (r0, r1), (a, b) in zip(factor_tiles(shape, block), tile_elements(shape, block)))


# ------------------------------------------------------------------------------ running a plan
def step_module(backend: str):
    """The step module of a concrete backend ("torch", "numba", "triton"), imported when first used:
    each has ``gefen_step_(tiles, gs, codebook, hyper, *, block, bits, ...)`` (``Tile`` records, their
    gradients, a ``Hyper`` record), ``refuses`` and ``data_refusal``."""
    return importlib.import_module(f"{__package__}.{backend}_ops")


def step_scalars(calls) -> list:
    """[(group, ``triton_ops.StepScalars``)]: one a group and device, holding the step counters and
    rows of step scalars of its calls' tiles (capturable); each call gets its tiles' rows."""
    ops, by = step_module("triton"), {}
    for call in calls:
        by.setdefault((id(call.group), call.tiles[0].p.device), (call.group, []))[1].append(call)
    out = []
    for (_, device), (group, cs) in by.items():
        tiles = [(call, t) for call in cs for t in call.tiles]
        sc = ops.StepScalars([call.states[t.owner][K.STEP] for call, t in tiles],
                             [call.states[t.owner][K.SEED] if call.sr else None for call, t in tiles],
                             [t.tile for _, t in tiles], device,
                             [stream_seed(call.states[t.owner][K.SEED], "factor") if call.factor_sr else None
                              for call, t in tiles])
        start = 0
        for call in cs:
            end = start + len(call.tiles)
            call.rows = sc.rows[start:end]
            call.factor_rows = sc.factor_rows[start:end] if call.factor_sr else None
            start = end
        out.append((group, sc))
    return out


def run(calls, scalars, codebook, *, bits: int) -> None:
    """Advance each call's step count and step its tiles on its path: on the host, or with
    ``scalars`` (capturable) one launch a group that advances the device counters and writes
    the rows of step scalars the calls read. ``codebook``: the optimizer's ``codebook.Codebook``."""
    for group, sc in scalars:
        beta1, beta2 = group["betas"]
        step_module("triton").advance_(sc, lr=group["lr"], beta1=beta1, beta2=beta2,
                                       weight_decay=group["weight_decay"])
    for call in calls:
        step = None if call.rows is not None else call.states[0][K.STEP] + 1
        run_call(call, step, codebook, bits=bits)
        if step is not None:  # counted once the kernel has taken it: a refused step is not
            for st in call.states:
                st[K.STEP] = step


def run_call(call: Call, step: int | None, codebook, *, bits: int) -> None:
    """Step one call's tiles on its path at ``step`` (None: the step count is on the device): the
    backend gets the ``Tile`` records, their gradients and the ``Hyper`` record."""
    grads = [signed(local_tensor(p.grad), call.group) for p in call.params]
    quant = call.group["quantize_first_moment"]
    values, tables = codebook.on(call.tiles[0].p.device) if quant else (None, None)
    h = call.hyper(step)
    if call.path == "numba" and call.native is not False:
        if call.native is None:
            call.native = numba_ops.prepare(call.tiles, call.gradients(grads), values, block=call.block, bits=bits,
                                            tables=tables, owners=[t.owner for t in call.tiles],
                                            offsets=[t.start for t in call.tiles], scale=call.scale) or False
        if call.native:
            numba_ops.run(call.native, grads, h, factor_seeds=call.seeds(step, "factor"))
            written(call)
            return
    if call.rows is None:
        extra = dict(seeds=call.seeds(step), code_seeds=call.seeds(step, "codes"))
        if call.factor_sr:
            extra["factor_seeds"] = call.seeds(step, "factor")
    else:
        extra = dict(seeds=True if call.sr else None, rows=call.rows)
        if call.factor_sr:
            extra["factor_rows"] = call.factor_rows
    if call.scale is not None:  # row-group scales (``state.SCALE_BLOCK``)
        extra["scale"] = call.scale
    step_module(call.path).gefen_step_(call.tiles, call.gradients(grads), values, h, tables=tables,
                                       block=call.block, bits=bits, **extra)
    if call.path != "torch":
        written(call)


def written(call: Call) -> None:
    """Tell autograd that a compiled kernel wrote the call's parameters through their addresses (a
    torch op in place does it itself): a graph that saved them then refuses its backward, as after
    AdamW's step, instead of using the new values."""
    torch.autograd.graph.increment_version(call.written)  # views share their base's counter


def signed(g: torch.Tensor, group) -> torch.Tensor:
    """The gradient a group steps on: ``g``, or under ``maximize`` a negated copy (exact), so that
    ``p.grad`` is never written (it may be shared by two parameters, require grad, or be expanded)."""
    return torch.neg(g) if group["maximize"] else g


def draw_seeds(params, states, seed: int, groups, every: bool = False) -> None:
    """Give each parameter of a call its stochastic-rounding seed once (``state.SEED``) where one of
    them is bf16 or fp16, or with ``every`` (stochastic codes) in any case (``optim._rounding``;
    ``Call.seeds`` derives each step's): a hash of the optimizer's ``seed`` and the parameter's
    index in ``groups``, so it does not depend on when it is drawn."""
    if not every and not any(local_tensor(p).dtype in STOCHASTIC_DTYPES for p in params):
        return
    for p, st in zip(params, states):
        if K.SEED not in st:
            index = next(i for i, q in enumerate(q for g in groups for q in g["params"]) if q is p)
            st[K.SEED] = step_seed(seed, index, 0)
