"""Gefen: AdamW with a block-shared second moment and a codebook-quantised first moment."""

from __future__ import annotations

from collections import defaultdict

import torch

from .._base import OptimizerBase, eager, local_tensor
from .._checks import check_option
from .._rounding import MASK32, hash32_int
from ..backends import BACKENDS
from . import distributed as _dist, state as K
from .checks import (check_adamw_keywords, check_capturable, check_group, check_param, check_refresh,
                     check_state_dict, check_state_fits)
from .codebook import Codebook, refresh_due
from .layout import SAVED_BEFORE, layout_of
from .partition import constant_magnitude
from .plan import (Call, draw_seeds, every_parameter_seeded, rounds_codes, run, seeded, signature, signed,
                   step_module, step_scalars, tiles_of)
from .torch_ops import histogram, remap_codes_


OPTIMIZER_WIDE = ("bits", "backend", "block_rule", "capturable",
                  "codebook_refresh_every")  # in every group, one value per optimizer


class Gefen(OptimizerBase):
    r"""AdamW with about one byte of state per parameter (Gefen, arXiv 2606.13894; upstream
    PyPI package ``gefen``).

    Each tensor is flattened (under FSDP: its local shard) and split into blocks of a length P chosen
    once from its first non-zero squared gradient (``partition.py``). One second moment is kept per
    block and the first moment as ``bits``-bit codes into one model-wide codebook, learned at the first
    step, times one fp32 scale per block. For a block b, with t the tensor's step::

        v_b <- beta2 v_b + (1 - beta2) mean_b(g^2)
        p   <- p (1 - lr weight_decay)
        m~  <- lerp(C[code] s_b, g, 1 - beta1);  s_b <- max_b |m~|;  code <- nearest(C, m~ / s_b)
        p   <- p - lr (C[code] s_b / (1 - beta1^t)) / (sqrt(v_b / (1 - beta2^t)) + eps)

    ``layout`` chooses what the state holds (``GefenLayout``, ``layout.py``): "factored" (the default:
    v per block times Adafactor's column factor, AdamW's loss on four of five models at about 1.19
    bytes a parameter), "compact" (the factored layout at Gefen-X's bytes), "published" (the article's
    algorithm, above) or "adamw" (``torch.optim.AdamW``'s state). Not for sparse gradients
    (``nn.Embedding(sparse=True)``: use ``DiskSparseAdam``) nor complex parameters. Each layout
    field, the backends and ``capturable`` are described in docs/USAGE.md; the exact state in
    ``reference.py``.

    Args:
        params: parameters or param groups (dicts); a group may set ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``maximize``, ``stochastic_rounding``, ``layout`` (a name or record for
            that group) and single layout fields; ``bits``, ``backend``, ``capturable``,
            ``block_rule`` and ``codebook_refresh_every`` are one per optimizer.
        lr: learning rate, a float or a one-element tensor. (Default: 1e-3)
        betas: coefficients of the first and second moment averages. (Default: (0.9, 0.999))
        eps: added to the denominator. (Default: 1e-8)
        weight_decay: decoupled weight decay, as AdamW's. (Default: 0.0)
        bits: code width of the first moment, 8 or 4. (Default: 8)
        layout: a layout name ("factored", "compact", "published", "adamw") or a ``GefenLayout``
            record (an ablation: ``layout_of("factored", bits).replace(...)``). (Default: "factored")
        backend: "torch", "numba" (CPU), "triton" (CUDA) or "auto" (the fastest that runs each
            parameter); :meth:`backend_of` tells which path updates a parameter. (Default: "auto")
        stochastic_rounding: write bf16 and fp16 parameters rounded stochastically, seeded from
            ``torch.initial_seed()``. (Default: False)
        verbose: print each tensor's block length when it is chosen. (Default: False)
        maximize: maximize the objective, as AdamW's. (Default: False)
        fused: upstream's keyword: False is ``backend="torch"``. (Default: None)
        capturable: keep step counts on the device so a step can be captured in a CUDA graph (Triton
            path only). (Default: False)
        amsgrad, foreach, differentiable: AdamW's keywords at AdamW's defaults (``foreach`` may be
            anything; the others are refused when True). (Default: False, None, False)

    Every option is in ``defaults`` and every group as a plain value (the layout's fields under their
    own names), so a state dict holds no record; re-creating the optimizer from a group takes those
    fields back as ``layout=GefenLayout(**fields)`` (docs/USAGE.md). The step always runs eagerly
    (``torch.compiler.disable``).
    """

    OPTIMIZER_WIDE = OPTIMIZER_WIDE
    WIDE_REASON = "one codebook and one backend choice serve every group"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bits=8,
                 layout="factored", backend="auto", *, stochastic_rounding=False, verbose=False, maximize=False,
                 fused=None, amsgrad=False, foreach=None, capturable=False, differentiable=False):
        check_option("bits", bits, (8, 4), "8 or 4 (an int)")
        layout = layout_of(layout, bits)
        check_refresh(layout.codebook_refresh_every, capturable)
        check_option("backend", backend, BACKENDS, f"one of {BACKENDS}")
        check_adamw_keywords(amsgrad=amsgrad, foreach=foreach, capturable=capturable,
                             differentiable=differentiable)
        if fused is False and backend not in ("auto", "torch"):
            raise ValueError(f"Gefen: fused=False asks for the torch step, backend={backend!r} "
                             "for a compiled one; pass one of them")
        self.backend = "torch" if fused is False else backend
        self.fused = fused
        self.capturable = capturable
        self.verbose = verbose
        self.bits = bits
        self.block_rule = layout.block_rule
        self.codebook_refresh_every = layout.codebook_refresh_every
        self._refreshed_at = None  # the step whose codebook refresh is done (a step's later calls skip it)
        self._codebook = Codebook(bits, histogram)
        # Every option lives in the groups as a plain value (state dicts hold no record, and load with
        # weights_only=True); the layout's fields under their own names, as checkpoints have them.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **layout.fields(),
                        stochastic_rounding=stochastic_rounding, maximize=maximize,
                        bits=bits, backend=self.backend, capturable=capturable)
        super().__init__(params, defaults)
        self._seed = None  # the optimizer's stochastic-rounding seed, drawn at its first use
        self._drop_plans()

    def add_param_group(self, param_group: dict) -> None:
        """torch's, where a group dict may also give ``layout`` (a name or record) for its fields;
        fields the dict names beside it are the dict's."""
        if isinstance(param_group, dict) and "layout" in param_group:
            group = dict(param_group)
            param_group = {**layout_of(group.pop("layout"), self.bits).fields(), **group}
        super().add_param_group(param_group)

    def __getstate__(self):
        # torch's keeps only defaults, state and groups; the codebook and settings travel too
        # (deepcopy, pickle). Backends (keyed by parameter) and lookup tables are rebuilt.
        out = super().__getstate__()
        out.update({k: self.__dict__[k] for k in _SETTINGS})
        out["codebook"] = self.codebook
        return out

    def __setstate__(self, state):
        state = dict(state)
        values = state.pop("codebook", None)
        super().__setstate__(state)
        if "_codebook" not in self.__dict__:  # unpickled or copied
            self._codebook = Codebook(self.bits, histogram)
            self._codebook.set(values)
        self.__dict__.setdefault("_seed", None)
        self.__dict__.setdefault("capturable", False)
        self.__dict__.setdefault("codebook_refresh_every", 0)
        self.__dict__.setdefault("_refreshed_at", None)
        self._drop_plans()
        for options in (*self.param_groups, self.defaults):  # pickled before an option existed: its old meaning
            for key in OPTIMIZER_WIDE:
                options.setdefault(key, self.__dict__[key])
            for key, value in SAVED_BEFORE.items():
                options.setdefault(key, value)
        if "_backends" not in self.__dict__:  # unpickled or copied (load_state_dict keeps them)
            self._resolve_all()

    def _drop_plans(self):
        """Forget every step plan (``plan.py``) and codebook copy: what they hold may be stale."""
        self._plans = {}  # plan.signature -> ([plan.Call], [(group, triton_ops.StepScalars)] when capturable)
        self._codebook.forget_copies()

    # --------------------------------------------------------------- groups and backends
    def _check_new_group(self, group, gi):
        check_group(group, gi)

    def _check_backends(self, group, gi, chosen):
        if group["capturable"]:
            for pi, p in enumerate(group["params"]):
                check_capturable(chosen[p].backend, f"parameter {pi} of group {gi} (shape {tuple(p.shape)}, "
                                                    f"on {chosen[p].device})")

    def _group_added(self, group):
        self._drop_plans()

    def _refusal(self, backend, p, group):
        return step_module(backend).refuses(p.dtype, group)

    def _state_device(self, p):
        st = self.state.get(p, {})
        return st[K.V].device if K.V in st else None

    def _path_of(self, p, group, backend) -> str:
        """The chosen backend, or "torch" where the backend's ``data_refusal`` hands ``p``'s steps to
        the torch step. That depends on data: the codebook (learned at the first step) for numba,
        ``p``'s block length (chosen at its first non-zero gradient, or loaded) for Triton; before
        they exist this is the chosen backend, the path unless they deviate."""
        st = self.state.get(p, {})
        return self._path(backend, group, st.get(K.BLOCK), st.get(K.SCALE_BLOCK))

    def _path(self, backend: str, group, block, scale=None) -> str:
        """``backend``, or "torch" where its ``data_refusal`` deviates for ``block``, the scale blocks
        (``scale``: ``state.SCALE_BLOCK``) and the codebook."""
        if backend == "torch" or rounds_codes(group):  # stochastic codes: the torch step's (``refuses``)
            return "torch"
        quant = group["quantize_first_moment"]
        tables = self._codebook.table() if quant and self.codebook is not None else None
        why = step_module(backend).data_refusal(block=block, bits=self.bits, quant=quant, tables=tables, scale=scale)
        return backend if why is None else "torch"

    def needs_every_gradient(self) -> bool:
        """True while the next step must see every parameter's gradient at once: before the
        codebook exists (groups with ``quantize_first_moment``), which the first step learns from
        all of them, and before a step that learns it again (``codebook_refresh_every``).
        ``step_in_backward`` holds the gradients of such a step until backward ends."""
        return self._codebook.needs_every_gradient(self.param_groups) or self._refresh_step() is not None

    # ----------------------------------------------------------------------------- codebook
    @property
    def codebook(self) -> torch.Tensor | None:
        """The model-wide codebook, fp32 (2**bits,) sorted; None before the first step learns it."""
        return self._codebook.values

    def codebook_histogram(self, grads, blocks=None) -> torch.Tensor:
        """``HIST_BINS`` counts (int64, CPU) of block-normalised gradients of ``grads`` ({param: grad}),
        each normalised by its state's scale blocks (``state.scale_length``) or by ``blocks`` ({param:
        scale-block length, or a block length whose default scale blocks are meant}).

        A distributed wrapper all-reduces this before :meth:`learn_codebook`.
        """
        by_block = defaultdict(list)
        for p, g in grads.items():
            by_block[K.scale_length(self.state[p]) if blocks is None else blocks[p]].append(g)
        return self._codebook.histogram_of(by_block)

    def learn_codebook(self, counts: torch.Tensor, device=None) -> torch.Tensor:
        """Exact optimal ``2**bits``-level codebook (ends -1, +1) of a histogram; sets it."""
        self._codebook.learn(counts, device)
        self._drop_plans()
        return self.codebook

    def set_codebook(self, codebook: torch.Tensor):
        """Use ``codebook`` (``2**bits`` sorted values) from the next step on."""
        self._codebook.set(codebook)
        self._drop_plans()

    def learn_from_gradients(self) -> None:
        """Learn the codebook from every gradient now in ``p.grad``, as the next step would, without
        stepping or creating state; nothing once it exists, but at a refresh step
        (``codebook_refresh_every``), where it learns it again and re-encodes the codes.

        ``step_in_backward`` calls this when the backward of the first step ends and then steps each
        parameter on its own, freeing its gradient at once: that step holds every gradient but only
        one parameter's new state and temporaries beside them, not all of it. The parameters are
        checked as a step checks them, and the step's own codebook is this one, so every result is
        the one-step result."""
        if self.codebook is not None:  # learned: learned again where a refresh step is due
            t = self._refresh_step()
            if t is not None:
                self._refresh_codebook(t)
            return
        if not self.needs_every_gradient():
            return
        grads, blocks = {}, {}
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                check_param(p, gi, pi)
                if p.grad is None or local_tensor(p).numel() == 0:
                    continue
                self._backend(p, group, gi, pi)
                g = local_tensor(p.grad)
                block = K.next_block(self.state[p], g, group, self.block_rule,
                                     where=f"parameter {pi} of group {gi} (shape {tuple(p.shape)})")
                if block is not None and group["quantize_first_moment"]:
                    grads[p], blocks[p] = signed(g, group), block
        self._learn_codebook(grads, blocks)

    def _learn_codebook(self, grads: dict, blocks: dict | None = None) -> None:
        """Learn the codebook, where there is none yet, from ``grads`` ({param: gradient as stepped})
        of the quantised groups (``codebook_histogram``'s ``blocks``)."""
        # [distributed] sharded (FSDP2) histograms are summed over the ranks, so every
        # rank learns the same codebook; a rank whose local shards are all empty still joins.
        qparams = self._quantised(with_grad=True)
        if self.codebook is not None or not (grads or _dist.joins_codebook(qparams)):
            return
        dev = next(iter(grads.values())).device if grads else local_tensor(qparams[0]).device
        counts = _dist.global_histogram(lambda gs: self.codebook_histogram(gs, blocks), grads, qparams)
        self.learn_codebook(counts, device=dev)

    def _refresh_step(self) -> int | None:
        """The step about to be taken where it relearns the codebook (``codebook.refresh_due``), or
        None: none is due, its refresh is done, or there is no codebook yet to refresh. The step is
        the one after the latest of the quantised parameters that have a gradient now (over the
        ranks under FSDP2): under ``step_in_backward`` the parameters stepped so far in a backward
        have none left, so the others' count still names the step under way."""
        if not self.codebook_refresh_every or self.codebook is None:
            return None
        qparams = self._quantised()
        steps = [st[K.STEP] for p in qparams if p.grad is not None and K.CODES in (st := self.state.get(p, {}))]
        t = _dist.latest_step(max(steps, default=0), qparams) + 1
        return t if refresh_due(t, self.codebook_refresh_every) and t != self._refreshed_at else None

    def _quantised(self, with_grad: bool = False) -> list:
        """The parameters of the groups that quantise their first moment (those with a gradient now)."""
        return [p for g in self.param_groups if g["quantize_first_moment"] for p in g["params"]
                if not with_grad or p.grad is not None]

    def _refresh_codebook(self, t: int) -> None:
        """At step ``t`` (``_refresh_step``'s), learn the codebook again from the gradients now in
        ``p.grad`` of the quantised parameters with codes, as the first step learns it, and
        re-encode every stored code onto it (``Codebook.relearn``). Without a gradient on any rank
        there is nothing to learn from: the next call with gradients does it. A gradient's NaN and
        infinite elements count as zeros here (the step then treats them as any step does), so a
        bad step does not stop training where it happens to be a refresh step."""
        grads = {p: _finite(signed(local_tensor(p.grad), g)) for g in self.param_groups if g["quantize_first_moment"]
                 for p in g["params"] if p.grad is not None and K.CODES in self.state.get(p, {})}
        qparams = self._quantised(with_grad=True)
        if not (grads or _dist.joins_codebook(qparams)):
            return
        counts = _dist.global_histogram(self.codebook_histogram, grads, qparams)
        if int(counts.sum()) == 0:  # no rank had a gradient element
            return
        table = self._codebook.relearn(counts)
        for st in self.state.values():
            if K.CODES in st:
                remap_codes_(st[K.CODES], table)
        self._refreshed_at = t
        self._drop_plans()

    # -------------------------------------------------------------------------------- state
    def _gather(self):
        """[(group, [(p, grad, backend)])] of parameters with gradients, each through ``_prepare``."""
        out = []
        for gi, group in enumerate(self.param_groups):
            items = []
            for pi, p in enumerate(group["params"]):
                check_param(p, gi, pi)
                backend = self._prepare(p, group, gi, pi)
                if backend is not None:
                    items.append((p, p.grad, backend))
            out.append((group, items))
        return out

    def _prepare(self, p, group, gi, pi) -> str | None:
        """The per-parameter entry of a step: ``p``'s backend once its state is ready for this
        gradient (created at the first non-zero one, ``state.first_gradient``; re-cut; cast), None
        where ``p`` is not stepped by a kernel now (no gradient, no elements, or an all-zero first
        gradient, which ``first_gradient`` has stepped)."""
        if p.grad is None or local_tensor(p).numel() == 0:
            return None
        backend = self._backend(p, group, gi, pi)
        st = self.state[p]
        if K.BLOCK not in st:
            g = local_tensor(p.grad)
            if not K.first_gradient(st, local_tensor(p), g, group, where=f"parameter {pi} of group {gi} (shape "
                                    f"{tuple(p.shape)})", bits=self.bits, block_rule=self.block_rule,
                                    capturable=self.capturable):
                return None
            self._drop_plans()
            if self.verbose:
                print(f"Gefen: parameter {pi} of group {gi}, shape {tuple(p.shape)}: "
                      f"block {st[K.BLOCK]} ({g.numel() // st[K.BLOCK]} second moments)")
        else:
            check_state_fits(st, local_tensor(p), group, self.bits, f"parameter {pi} of group {gi}")
            if K.follow_cast(st, K.state_dtype(local_tensor(p).dtype, group)):
                self._drop_plans()
        if st.get(K.PROVISIONAL) and not constant_magnitude(local_tensor(p.grad)):
            K.recut(st, local_tensor(p.grad), group, codebook=self.codebook, bits=self.bits,
                    block_rule=self.block_rule)
            self._drop_plans()
        return backend

    # --------------------------------------------------------------------------------- step
    # The step chooses blocks and learns the codebook from data, which a compiled graph would not
    # see (torch.compile around a training step): it always runs eagerly.
    @eager
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if _dist.is_state_dict_init_step(self):  # [distributed] torch's zero-grad lr=0 probe
            return loss
        if self._seed is None and any(seeded(g) for g in self.param_groups):
            # [distributed] every rank steps here, with or without a parameter to round
            self._seed = _dist.shared_seed(fresh_seed())
        self._step()
        return loss

    def _step(self):
        t = self._refresh_step()
        if t is not None:
            self._refresh_codebook(t)
        key = signature(self.param_groups, local_tensor)
        plan = self._plans.get(key)
        if plan is not None and all(c.current() for c in plan[0]):
            run(*plan, self._codebook, bits=self.bits)
            return
        work = self._gather()
        self._learn_codebook({p: signed(local_tensor(g), group) for group, items in work
                              if group["quantize_first_moment"] for p, g, _ in items})
        calls = [call for group, items in work for call in self._calls(group, items)]
        scalars = step_scalars(calls) if self.capturable else []
        run(calls, scalars, self._codebook, bits=self.bits)
        settled = all(K.BLOCK in self.state[p] and not self.state[p].get(K.PROVISIONAL)
                      for group in self.param_groups for p in group["params"]
                      if p.grad is not None and local_tensor(p).numel())
        if settled:  # a plan holds no parameter whose block or state may still change
            if len(self._plans) > 4 * sum(len(g["params"]) for g in self.param_groups) + 16:
                self._plans.clear()
            self._plans[key] = (calls, scalars)

    def _calls(self, group, items) -> list:
        """The ``plan.Call`` s of one group's parameters with gradients (``_gather``'s items): one a
        bucket of block length, step, device, state dtype, path, factor (whether the state holds w:
        a vector may hold none in a factored group, ``state.holds_factor``) and scale blocks."""
        buckets = defaultdict(list)
        for p, _, backend in items:
            st = self.state[p]  # device step counters are each read on the device: no split by step
            step = None if self.capturable else st[K.STEP]
            buckets[(st[K.BLOCK], step, local_tensor(p).device, st[K.V].dtype, backend, K.W in st,
                     st.get(K.SCALE_BLOCK))].append(p)
        calls = []
        for (block, _, _, _, backend, _, scale), params in buckets.items():
            states = [self.state[p] for p in params]
            if seeded(group):
                draw_seeds(params, states, self._seed, self.param_groups, every=every_parameter_seeded(group))
            tiles = [t for k, (p, st) in enumerate(zip(params, states))
                     for t in tiles_of(k, local_tensor(p), st, bits=self.bits)]
            path = self._path(backend, group, block, scale)
            if self.capturable:
                gi = next(i for i, g in enumerate(self.param_groups) if g is group)
                pi = next(i for i, q in enumerate(group["params"]) if q is params[0])
                check_capturable(path, f"parameter {pi} of group {gi} (shape {tuple(params[0].shape)}, block {block})")
            calls.append(Call(group, path, block, params, states, tiles))
        return calls

    # --------------------------------------------------------------------------- state dict
    def _pack_state(self, sd):
        sd[K.CODEBOOK] = None if self.codebook is None else self.codebook.clone()
        sd[K.BITS] = self.bits
        sd[K.ROUNDING_SEED] = self._seed
        return _dist.to_distributed_state_dict(self, sd)  # [distributed] DCP-ready form

    def _unpack_state(self, state_dict):
        sd = _dist.from_distributed_state_dict(self, state_dict)  # [distributed]
        sd, checked, codebook, seed = check_state_dict(sd, self.param_groups, bits=self.bits, local=local_tensor,
                                                       wide={k: self.defaults[k] for k in OPTIMIZER_WIDE})
        self._restore_layout(sd, lambda p, _: K.restored(checked[id(p)], local_tensor(p).device,
                                                          capturable=self.capturable))
        params = [p for g in self.param_groups for p in g["params"]]
        if seed is not None:
            self._seed = seed
        self._refreshed_at = None  # the loaded states' next refresh step is still to come
        self._drop_plans()
        if codebook is None:
            self.set_codebook(None)
        else:
            self.set_codebook(codebook.to(local_tensor(params[0]).device) if params else codebook)


def _finite(g: torch.Tensor) -> torch.Tensor:
    """``g``, or a copy with its NaN and infinite elements as zeros where it has any."""
    return g if bool(torch.isfinite(g).all()) else torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)


_SETTINGS = ("backend", "fused", "verbose", "bits", "block_rule", "capturable", "codebook_refresh_every", "_seed",
             "_refreshed_at")


def fresh_seed() -> int:
    """A 32-bit stochastic-rounding seed from the seed of torch's default generator
    (``torch.initial_seed()``: runs repeat given ``torch.manual_seed``) without drawing from it, so
    the user's random stream is the same with or without rounding."""
    s = torch.initial_seed()
    return hash32_int(hash32_int(s & MASK32) ^ (s >> 32))

