"""Checks of Gefen's arguments and state: at construction, at ``load_state_dict`` and before a
compiled kernel (numba, Triton) is launched on the state, which must never see a buffer of
another dtype, size or device than the layout of ``state.py`` it was built for. What each backend
cannot take, each backend module says itself (``refuses``, ``data_refusal``); this module imports
none of them."""

from __future__ import annotations

import torch

from .._checks import check_flags, check_hyper, check_option
from . import state as K
from .state import FACTOR_DTYPES, factor_dtype, holds_factor, state_dtype, whole_factor
from .partition import factor_tiles, tile_elements
from .reference import num_code_bytes, num_scales


def float64_state_refusal(param_dtype: torch.dtype, group) -> str | None:
    """Why a compiled step cannot keep this parameter's moments (float64, ``state_dtype``), or None:
    the refusal both compiled backends share (their ``refuses``)."""
    if state_dtype(param_dtype, group) == torch.float64:
        return ("its moments are float64 (float64 parameters with share_second_moment=False and "
                "quantize_first_moment=False, AdamW in float64), which only the torch step keeps")
    return None


def stochastic_codes_refusal(group) -> str | None:
    """Why a compiled step cannot step ``group``, or None: the stochastic rounding of the first
    moment's codes (``first_moment_rounding="stochastic"``) is the torch step's alone (both
    compiled backends' ``refuses``)."""
    if group["first_moment_rounding"] == "stochastic" and group["quantize_first_moment"]:
        return ("its group rounds the first moment's codes stochastically (first_moment_rounding="
                "'stochastic'), which only the torch step does")
    return None


def makes_row_group_scales(group) -> bool:
    """True where ``group`` keeps one first-moment scale per group of a matrix's rows
    (``row_group_scales`` under a quantised, factored second moment): states of such a group may
    hold ``state.SCALE_BLOCK``."""
    return bool(group.get("row_group_scales") and group["quantize_first_moment"] and group["factor_second_moment"])


def expected_state(n: int, block: int, bits: int, quant: bool, dtype: torch.dtype,
                   factored: bool = False, tiles: int = 1, scale: int | None = None,
                   factor: torch.dtype = torch.float32) -> dict:
    """{key: (dtype, numel)} of the per-parameter tensors of an n-element parameter (``tiles``:
    of the factored second moment, ``partition.factor_tiles``; ``scale``: the scale-block length
    where it is not the default of ``block``, ``state.SCALE_BLOCK``; ``factor``: w's dtype,
    ``state.factor_dtype``)."""
    out = {K.V: (dtype, n // block)}
    if factored:
        out[K.W] = (factor, tiles * block)
    if quant:
        out[K.SCALES] = (torch.float32, num_scales(n, scale or block))
        out[K.CODES] = (torch.uint8, num_code_bytes(n, bits))
    else:
        out[K.M] = (dtype, n)
    return out


def check_state_fits(st, p, group, bits, where: str):
    """Raise ``ValueError`` unless parameter ``p``'s existing state (``st``, with a block) has the
    layout of its shape and group options now: a parameter replaced by one of another size or
    shape after its state was made (``p.data = ...``), or an option that decides the layout
    (``share_second_moment``, ``quantize_first_moment``, ``factor_second_moment``,
    ``share_vector_second_moment``, ``whole_matrix_factor``, ``factor_dtype``; ``row_group_scales`` switched off) edited in
    the group since, is refused before any kernel sees
    the state (a step is factored where its state holds w: ``plan.Call.factored``)."""
    n, block = p.numel(), st[K.BLOCK]
    tiles = len(factor_tiles(tuple(p.shape), block, whole_factor(group))) if n % block == 0 else 0
    want = expected_state(n, block, bits, group["quantize_first_moment"], state_dtype(p.dtype, group),
                          holds_factor(group, p.dim()), tiles, st.get(K.SCALE_BLOCK), factor_dtype(group)) if tiles else {}
    per_element = not group["share_second_moment"] and block != 1  # its blocks say otherwise
    grouped = K.SCALE_BLOCK in st and not makes_row_group_scales(group)  # a layout its group does not make
    if (per_element or grouped or not want or (K.W in st) != (K.W in want)
            or any(key not in st or st[key].numel() != size or (key == K.W and st[key].dtype != dtype)
                   for key, (dtype, size) in want.items())):
        made = st[K.V].numel() * block
        raise ValueError(f"Gefen: {where} is now {tuple(p.shape)} ({n} elements), its state was made for "
                         f"{made} elements, of another shape or under other group options (block {block}): a "
                         "parameter keeps its shape, and its group its share_second_moment, quantize_first_moment, "
                         "factor_second_moment, share_vector_second_moment, row_group_scales, "
                         "whole_matrix_factor and factor_dtype, once its state exists; build a new optimizer "
                         "for another")


def check_group(group, gi):
    """A parameter group's parameters and values, with AdamW's sentences where AdamW checks them."""
    for pi, p in enumerate(group["params"]):
        if p.is_complex():
            raise ValueError(f"Gefen does not support complex parameters (group {gi}, parameter "
                             f"{pi}); optimize torch.view_as_real(p) as a real parameter instead")
        if not p.is_floating_point():
            raise ValueError(f"Gefen: parameter {pi} of group {gi} has dtype {p.dtype}, "
                             "expected a floating-point dtype")
    try:
        check_hyper(group["lr"], group["betas"], group["eps"], weight_decay=group["weight_decay"],
                    lr_may_be_zero=True)
        check_flags(**{k: group[k] for k in FLAGS if k in group})
        check_row_group_scales(group.get("row_group_scales", False))
        check_option("first_moment_rounding", group.get("first_moment_rounding", "nearest"), ROUNDINGS,
                     f"one of {ROUNDINGS}")
        check_option("factor_dtype", group.get("factor_dtype", "float32"), tuple(FACTOR_DTYPES),
                     f"one of {tuple(FACTOR_DTYPES)} (a string)")
    except ValueError as exc:
        raise ValueError(f"{exc} (Gefen, group {gi})") from None
    if group.get("first_moment_rounding") == "stochastic" and not group["quantize_first_moment"]:
        raise ValueError(f"Gefen: group {gi} has first_moment_rounding='stochastic' and quantize_first_moment="
                         "False: only codes are rounded, an fp32 first moment is not; set "
                         "first_moment_rounding='nearest' for that group, or quantize its first moment")


ROUNDINGS = ("nearest", "stochastic")  # first_moment_rounding: how m~ / s becomes a code
FLAGS = ("share_second_moment", "quantize_first_moment", "factor_second_moment", "share_vector_second_moment",
         "share_matrix_rows", "whole_matrix_factor", "maximize", "stochastic_rounding", "capturable")


def check_row_group_scales(value):
    """``row_group_scales`` is True, False or an int of at least 1 (the most elements a scale spans)."""
    if not (type(value) is bool or (type(value) is int and value >= 1)):
        raise ValueError(f"Invalid row_group_scales value: {value!r}; expected True, False or the most "
                         "elements one first-moment scale may span, an int >= 1")


def check_refresh(every, capturable):
    """``codebook_refresh_every`` is an int of at least 0, and 0 under ``capturable``."""
    if type(every) is not int or every < 0:
        raise ValueError(f"Invalid codebook_refresh_every value: {every!r}; expected an int >= 0 (the steps "
                         "between codebook refreshes; 0 learns it once)")
    if every and capturable is True:
        raise ValueError("Gefen does not implement codebook_refresh_every with capturable=True: a captured "
                         "graph would replay the old codebook; set codebook_refresh_every=0 or capturable=False")


def check_adamw_keywords(*, amsgrad, foreach, capturable, differentiable):
    """``torch.optim.AdamW``'s keywords that Gefen takes at their defaults (so a config written for
    AdamW runs unchanged) and refuses by name otherwise. ``foreach`` chooses among AdamW's
    implementations; Gefen has its own backends, so any value is taken. ``capturable`` is Gefen's
    own too (``check_capturable`` per parameter)."""
    check_option("foreach", foreach, (None, True, False), "None, True or False")
    check_flags(capturable=capturable)
    refused = {"amsgrad": (amsgrad, "it keeps a per-element maximum of v, which the shared v has no room for"),
               "differentiable": (differentiable, "the quantised first moment has no gradient")}
    for name, (value, why) in refused.items():
        check_flags(**{name: value})
        if value:
            raise ValueError(f"Gefen does not implement {name}=True: {why}; leave {name}=False")


def check_capturable(backend: str, where: str):
    """Raise ``ValueError`` unless a parameter of a ``capturable=True`` optimizer is stepped by the
    Triton kernels, the one path that reads its step count, lr and bias corrections on the device."""
    if backend != "triton":
        raise ValueError(f"Gefen does not implement capturable=True for {where}: its step would run on "
                         f"{backend}; capturable needs the Triton step for every parameter (CUDA tensors with "
                         "backend 'auto' or 'triton'; CPU tensors only under TRITON_INTERPRET=1)")


def check_saved(st, p, group, bits, k):
    """Raise ``ValueError`` unless a saved per-parameter state fits parameter ``p`` of ``group``
    exactly (keys, step, block, and each tensor's dtype and 1-D size); device and memory layout
    are converted at load (a copy is exact). Returns the state with ``step`` as an int: a saved step
    may be an int or a one-element tensor holding one (a capturable optimizer's float32 counter, as
    torch's capturable AdamW saves it)."""
    n, shape = p.numel(), tuple(p.shape)
    where = f"Gefen.load_state_dict: the state of parameter {k} (shape {shape})"
    step, block = st.get(K.STEP), st.get(K.BLOCK)
    if torch.is_tensor(step) and step.numel() == 1 and step.dtype != torch.bool:
        value = step.item()
        step = int(value) if float(value).is_integer() else value
    if not (isinstance(step, int) and 0 <= step < 2**62):
        raise ValueError(f"{where} has step {step!r}; expected a non-negative int")
    seed = st.get(K.SEED)
    if torch.is_tensor(seed) and seed.numel() == 1 and not seed.is_floating_point():
        seed = int(seed)
    if K.SEED in st:
        if not (isinstance(seed, int) and 0 <= seed < 2**32):
            raise ValueError(f"{where} has seed {seed!r}; expected an int in [0, 2**32)")
        st = dict(st, **{K.SEED: seed})
    if K.PROVISIONAL in st:
        if st[K.PROVISIONAL] is not True:
            raise ValueError(f"{where} has {K.PROVISIONAL!r} = {st[K.PROVISIONAL]!r}; expected True (or no key)")
        if K.BLOCK not in st:
            raise ValueError(f"{where} has {K.PROVISIONAL!r} but no {K.BLOCK!r}")
    if {"exp_avg", "exp_avg_sq"} & set(st):
        raise ValueError(f"{where} is torch.optim.Adam's or AdamW's (keys {sorted(st)}), not Gefen's: Gefen "
                         "keeps its own state layout (state.py), even where it reduces to AdamW "
                         "(share_second_moment=False, quantize_first_moment=False); load an AdamW state dict "
                         "into torch.optim.AdamW, or start Gefen without it")
    _check_group_matches(st, group, p.dim(), where)
    extra = {K.SEED, K.PROVISIONAL, K.SCALE_BLOCK} & set(st)
    if K.BLOCK not in st:  # a tensor that has only seen zero gradients
        if set(st) - extra != {K.STEP}:
            raise ValueError(f"{where} has keys {sorted(st)} but no {K.BLOCK!r}")
        return dict(st, **{K.STEP: step})
    if not (isinstance(block, int) and block >= 1 and n % block == 0):
        raise ValueError(f"{where} has block {block!r}, which does not fit its shape ({n} elements); "
                         "the state dict comes from a model with other shapes")
    whole = whole_factor(group)
    tiles = len(factor_tiles(shape, block, whole))
    scale = st.get(K.SCALE_BLOCK)
    if scale is not None and not (isinstance(scale, int) and scale > block and scale % block == 0
                                  and all((b - a) % scale == 0 for a, b in tile_elements(shape, block, whole))):
        raise ValueError(f"{where} has {K.SCALE_BLOCK!r} {scale!r}, which is no multiple of its block {block} "
                         "longer than it that divides each factor tile; the state dict comes from a model with "
                         "other shapes")
    if group["factor_second_moment"] and tiles > 1 and _is_vector(st.get(K.W), block):
        # a factor saved as one w for the whole tensor, before tiles: each tile starts from it
        st = dict(st, **{K.W: st[K.W].repeat(tiles)})
    want = expected_state(n, block, bits, group["quantize_first_moment"],
                          state_dtype(p.dtype, group), holds_factor(group, p.dim()), tiles, scale,
                          factor_dtype(group))
    if set(st) - extra != set(want) | {K.STEP, K.BLOCK}:
        raise ValueError(f"{where} has keys {sorted(st)}, expected "
                         f"{sorted(set(want) | {K.STEP, K.BLOCK})} for this group's "
                         "quantize_first_moment and factor_second_moment settings")
    for key, (dtype, size) in want.items():
        t = st[key]
        if not torch.is_tensor(t) or t.dtype != dtype or t.dim() != 1 or t.numel() != size:
            got = f"{t.dtype} {tuple(t.shape)}" if torch.is_tensor(t) else type(t).__name__
            raise ValueError(f"{where}: {key!r} must be a 1-D {dtype} tensor of {size} elements "
                             f"(block {block}), got {got}: it does not fit its shape or dtype; load the "
                             "state dict as it was saved (no dtype casts), into the model it was "
                             "saved from")
    return dict(st, **{K.STEP: step})


def _check_group_matches(st, group, ndim: int, where: str):
    """The saved group's layout options say what the saved state holds (quantised codes or a plain
    first moment, a factor or none; ``state.holds_factor`` for a tensor of ``ndim`` dimensions): a
    group edited apart from its state is named, not guessed."""
    if K.BLOCK not in st:
        return
    quant = K.CODES in st or K.SCALES in st
    found = []
    if (quant or K.M in st) and quant != bool(group["quantize_first_moment"]):
        found.append(("quantize_first_moment", "codes and scales (a quantised first moment)" if quant
                      else "an fp32 first moment 'm'"))
    if (K.W in st) != holds_factor(group, ndim):
        vector_option = ndim < 2 and group["factor_second_moment"]  # the option that decides a vector's w
        found.append(("share_vector_second_moment" if vector_option else "factor_second_moment",
                      "a factor 'w'" if K.W in st else "no factor 'w'"))
    w = st.get(K.W)
    if torch.is_tensor(w) and holds_factor(group, ndim) and w.dtype != factor_dtype(group) and w.dtype in (
            torch.float32, torch.bfloat16):
        found.append(("factor_dtype", f"a {str(w.dtype).removeprefix('torch.')} factor 'w'"))
    if K.SCALE_BLOCK in st and not (group.get("row_group_scales") and K.W in st and quant):
        found.append(("row_group_scales", f"scale blocks of its own length {K.SCALE_BLOCK!r}"))
    for option, holds in found:
        raise ValueError(f"{where} holds {holds}, but its saved group says {option}={group[option]}: the "
                         "groups of the state dict do not describe its state (edited apart from it); load "
                         f"it as it was saved, or set the saved group's {option} to what its state holds")


def _is_vector(t, size) -> bool:
    return torch.is_tensor(t) and t.dtype == torch.float32 and t.dim() == 1 and t.numel() == size


def check_factors(ps, ws, *, block, device_type="cpu", dtypes=(torch.float32,)):
    """Raise ``ValueError`` unless ``ws`` holds one contiguous factor of ``block`` elements per
    parameter, all of one dtype among ``dtypes``, on ``device_type`` (the kernels read ``w``
    through its address)."""
    if len(ws) != len(ps):
        raise ValueError(f"Gefen kernel: {len(ws)} factors w for {len(ps)} parameters")
    for i, w in enumerate(ws):
        if (w.dtype not in dtypes or w.dtype != ws[0].dtype or w.numel() != block or not w.is_contiguous()
                or w.device.type != device_type):
            names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"Gefen kernel: w[{i}] must be a contiguous {names} {device_type} tensor "
                             f"of {block} elements, as w[0], got {w.dtype} {tuple(w.shape)} on {w.device}")


def check_launch(ps, gs, vs, scales, codes, *, block, bits, quant, device_type="cpu", scale=None):
    """Raise ``ValueError`` unless every tensor of a kernel call has the layout the kernel reads:
    parameters and gradients of equal size, v/scales fp32, codes uint8 (fp32 m when not
    ``quant``), each contiguous, of the layout's size and on ``device_type``."""
    if not len(ps) == len(gs) == len(vs) == len(scales) == len(codes):
        raise ValueError("Gefen kernel: p, g, v, scales, codes must be lists of the same length")
    for i, (p, g, v, s, c) in enumerate(zip(ps, gs, vs, scales, codes)):
        n = p.numel()
        if g.numel() != n or not p.is_floating_point() or not g.is_floating_point():
            raise ValueError(f"Gefen kernel: p[{i}] ({p.dtype}, {n} elements) and g[{i}] "
                             f"({g.dtype}, {g.numel()} elements) must be floating tensors of one size")
        if n % block:
            raise ValueError(f"Gefen kernel: block={block} does not divide p[{i}].numel()={n}")
        if scale is not None and (scale % block or n % scale):
            raise ValueError(f"Gefen kernel: scale blocks of {scale} elements do not hold whole blocks of {block} "
                             f"or do not divide p[{i}].numel()={n}")
        want = expected_state(n, block, bits, quant, torch.float32, scale=scale)
        got = {K.V: v, K.SCALES: s, K.CODES: c} if quant else {K.V: v, K.M: c}
        for key, (dtype, size) in want.items():
            t = got[key]
            if t.dtype != dtype or t.numel() != size or not t.is_contiguous():
                raise ValueError(f"Gefen kernel: {key}[{i}] must be a contiguous {dtype} tensor of "
                                 f"{size} elements, got {t.dtype} {tuple(t.shape)} "
                                 f"(contiguous: {t.is_contiguous()})")
        for name, t in (("p", p), ("g", g), *got.items()):
            if t.device.type != device_type:
                raise ValueError(f"Gefen kernel: {name}[{i}] is on {t.device}, expected "
                                 f"{device_type} tensors")


def check_state_dict(sd: dict, groups: list, *, bits: int, wide: dict, local) -> tuple:
    """Check a Gefen state dict against this optimizer's ``groups`` before anything is written.

    Returns (the state dict with its groups completed, {id(param): checked saved state}, codebook,
    rounding seed). A keyword a dict was saved before is at its old meaning (the published rule,
    a vector's v per element under the factor, minimizing); the optimizer-wide options (``wide``)
    stay this optimizer's, and so does each group's stochastic_rounding: how this run writes its
    weights, not a property of the saved state; so does its first_moment_rounding (how this run
    rounds its codes; the saved codes are codes either way). ``local``: the local shard of a
    parameter (DTensor) or the parameter.
    """
    sd = dict(sd)
    codebook = sd.pop(K.CODEBOOK, None)
    seed = sd.pop(K.ROUNDING_SEED, None)
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**32):
        raise ValueError(f"Gefen.load_state_dict: {K.ROUNDING_SEED!r} is {seed!r}; expected an int in "
                         "[0, 2**32) or None")
    saved_bits = sd.pop(K.BITS, bits)
    if saved_bits != bits:
        raise ValueError(f"Gefen.load_state_dict: the state dict was saved with bits={saved_bits}, "
                         f"this optimizer has bits={bits}; construct it with bits={saved_bits}")
    if len(sd["param_groups"]) != len(groups):
        raise ValueError(f"Gefen.load_state_dict: the state dict has {len(sd['param_groups'])} parameter "
                         f"groups, this optimizer {len(groups)}; load it into the optimizer "
                         "it was saved from")
    from .layout import SAVED_BEFORE  # (layout.py reuses this module's checks)

    sd["param_groups"] = [{**SAVED_BEFORE, **g,
                           "stochastic_rounding": mine["stochastic_rounding"],
                           "first_moment_rounding": mine["first_moment_rounding"], **wide}
                          for g, mine in zip(sd["param_groups"], groups)]
    saved = sd.get("state", {})
    params = [(p, g) for g in groups for p in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    if len(ids) != len(params):
        raise ValueError(f"Gefen.load_state_dict: the state dict has {len(ids)} parameters, "
                         f"this optimizer {len(params)}; load it into the model it was saved from")
    loaded_group = {pid: g for g in sd["param_groups"] for pid in g["params"]}
    for gi, g in enumerate(sd["param_groups"]):
        check_group(dict(g, params=[]), gi)
    checked = {id(p): check_saved(saved[pid], local(p), loaded_group[pid], bits, k)
               for k, (pid, (p, _)) in enumerate(zip(ids, params)) if pid in saved}
    return sd, checked, codebook, seed


def check_param(p, gi: int, pi: int):
    """A parameter a step can take: not on the meta device (no data), no sparse gradient."""
    if p.is_meta:
        raise RuntimeError(
            f"Gefen: parameter {pi} of group {gi} (shape {tuple(p.shape)}) is on the meta device, "
            "so it holds no data and is never trained: module.to_empty(...) gives a module new "
            "Parameters, and this optimizer holds the old ones; build the optimizer after "
            "to_empty (or set torch.__future__.set_swap_module_params_on_conversion(True) "
            "before it, which keeps the Parameter objects)")
    if p.grad is not None and p.grad.is_sparse:
        raise RuntimeError(
            f"Gefen does not support sparse gradients (group {gi}, parameter {pi}, "
            f"shape {tuple(p.shape)}); for nn.Embedding(sparse=True) use "
            "optim.DiskSparseAdam, or build the embedding with sparse=False")
