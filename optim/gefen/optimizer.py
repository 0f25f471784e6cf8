"""Gefen: AdamW with a block-shared second moment and a codebook-quantised first moment."""

from __future__ import annotations

from collections import defaultdict

import torch

from .._base import OptimizerBase, eager, local_tensor
from .._checks import check_option
from .._compiling import compile_notice
from .._rounding import MASK32, hash32_int
from ..backends import BACKENDS
from . import distributed as _dist, state as K
from .checks import check_adamw_keywords, check_capturable, check_group, check_refresh, check_state_dict
from .codebook import Codebook
from .gather import calls, gather, path
from .layout import SAVED_BEFORE, layout_of
from .learning import learn_first, learn_from_gradients, refresh, refresh_step
from .plan import run, seeded, signature, signed, step_module, step_scalars
from .tiling import histogram


OPTIMIZER_WIDE = ("bits", "backend", "block_rule", "capturable",
                  "codebook_refresh_every")  # in every group, one value per optimizer


class Gefen(OptimizerBase):
    r"""AdamW with about one byte of state per parameter (Gefen, arXiv 2606.13894; upstream PyPI
    package ``gefen``).

    Each tensor (under FSDP: its local shard) is split into blocks of a length chosen once from its
    first non-zero squared gradient; one second moment is kept per block and the first moment as
    ``bits``-bit codes into one model-wide codebook, learned at the first step, times one fp32 scale
    per block (the exact step is ``reference.gefen_step``). ``layout`` chooses what the state holds:
    "factored" (the default: v per block times Adafactor's column factor), "compact" (the factored
    layout at Gefen-X's bytes), "published" (the article's algorithm) or "adamw" (AdamW's state); a
    ``GefenLayout`` record is an ablation (``layout.py``). Not for sparse gradients (use
    ``DiskSparseAdam``) nor complex parameters.

    Takes AdamW's keywords and five of its own: ``bits`` (8 or 4), ``layout`` (a name or record; a
    group may give its own), ``backend`` ("auto", "torch", "numba", "triton"; ``backend_of`` says
    which path updates a parameter), ``stochastic_rounding`` (bf16 and fp16 weights written rounded
    stochastically) and ``verbose`` (print each tensor's block). Upstream's ``fused=False`` is
    ``backend="torch"``; ``capturable`` keeps step counts on the device (Triton path). ``bits``,
    ``backend``, ``capturable`` and the layout's ``block_rule`` and ``codebook_refresh_every`` are one
    per optimizer. Every option, refusal and limit: docs/USAGE.md.

    The groups hold every option as a plain value (the layout's fields under their own names), so a
    state dict holds no record; re-creating the optimizer from a group takes the fields back as
    ``layout=GefenLayout(**fields)``. The step always runs eagerly (``torch.compiler.disable``).
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
        """The chosen backend, or "torch" where its data refusal hands ``p``'s steps to the torch step
        (``gather.path``; before the block and codebook exist, the chosen backend)."""
        st = self.state.get(p, {})
        return path(self, backend, group, st.get(K.BLOCK), st.get(K.SCALE_BLOCK))

    def needs_every_gradient(self) -> bool:
        """True while the next step must see every parameter's gradient at once: before the codebook
        exists (groups with ``quantize_first_moment``), which the first step learns from all of them,
        and before a step that learns it again (``codebook_refresh_every``). ``step_in_backward``
        holds the gradients of such a step until backward ends."""
        return self._codebook.needs_every_gradient(self.param_groups) or refresh_step(self) is not None

    # ----------------------------------------------------------------------------- codebook
    @property
    def codebook(self) -> torch.Tensor | None:
        """The model-wide codebook, fp32 (2**bits,) sorted; None before the first step learns it."""
        return self._codebook.values

    def codebook_histogram(self, grads, blocks=None) -> torch.Tensor:
        """``HIST_BINS`` counts (int64, CPU) of block-normalised gradients of ``grads`` ({param: grad}),
        each normalised by its state's scale blocks or by ``blocks`` ({param: scale-block length, or a
        block length whose default scale blocks are meant}). A distributed wrapper all-reduces this
        before :meth:`learn_codebook`."""
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
        stepping or creating state; nothing once it exists, but at a refresh step, where it learns it
        again and re-encodes the codes (``learning.py``). ``step_in_backward`` calls this when the
        backward of the first step ends, then steps each parameter on its own and frees its gradient
        at once: the results are the one-step results."""
        learn_from_gradients(self)

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
        with compile_notice("Gefen", lambda: any(r.backend == "numba" for r in self._backends.values())):
            self._step()
        return loss

    def _step(self):
        t = refresh_step(self)
        if t is not None:
            refresh(self, t)
        key = signature(self.param_groups, local_tensor)
        plan = self._plans.get(key)
        if plan is not None and all(c.current() for c in plan[0]):
            run(*plan, self._codebook, bits=self.bits)
            return
        work = gather(self)
        learn_first(self, {p: signed(local_tensor(g), group) for group, items in work
                           if group["quantize_first_moment"] for p, g, _ in items})
        steps = [call for group, items in work for call in calls(self, group, items)]
        scalars = step_scalars(steps) if self.capturable else []
        run(steps, scalars, self._codebook, bits=self.bits)
        if all(K.BLOCK in self.state[p] and not self.state[p].get(K.PROVISIONAL) for group in self.param_groups
               for p in group["params"] if p.grad is not None and local_tensor(p).numel()):
            # a plan holds no parameter whose block or state may still change
            if len(self._plans) > 4 * sum(len(g["params"]) for g in self.param_groups) + 16:
                self._plans.clear()
            self._plans[key] = (steps, scalars)

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


_SETTINGS = ("backend", "fused", "verbose", "bits", "block_rule", "capturable", "codebook_refresh_every", "_seed",
             "_refreshed_at")


def fresh_seed() -> int:
    """A 32-bit stochastic-rounding seed from the seed of torch's default generator
    (``torch.initial_seed()``: runs repeat given ``torch.manual_seed``) without drawing from it, so
    the user's random stream is the same with or without rounding."""
    s = torch.initial_seed()
    return hash32_int(hash32_int(s & MASK32) ^ (s >> 32))

