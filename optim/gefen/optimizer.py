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
from .partition import RULES, constant_magnitude
from .plan import (Call, draw_seeds, every_parameter_seeded, rounds_codes, run, seeded, signature, signed,
                   step_module, step_scalars, tiles_of)
from .torch_ops import histogram, remap_codes_


OPTIMIZER_WIDE = ("bits", "backend", "block_rule", "capturable",
                  "codebook_refresh_every")  # in every group, one value per optimizer


class Gefen(OptimizerBase):
    r"""AdamW with about one byte of state per parameter (Gefen, arXiv 2606.13894; upstream
    PyPI package ``gefen``).

    Each tensor is flattened (under FSDP: its local shard) and split into blocks of a length P
    chosen once from its first non-zero squared gradient (``partition.py``; no parameter names needed).
    One second moment is kept per block and the first moment as ``bits``-bit codes into one
    model-wide codebook, learned at the first step as the exact optimal ``2**bits``-level
    quantiser (ends pinned at -1, +1) of a ``HIST_BINS`` = 4096-bin histogram of gradients divided by the
    absmax of their scale block (P, or the chunk of 256 when P = 1: upstream divides a P = 1
    tensor's gradients element by element, which puts all their mass at -1 and +1), times one
    fp32 scale per scale block. For a block b, with t the tensor's step::

        v_b <- beta2 v_b + (1 - beta2) mean_b(g^2)
        p   <- p (1 - lr weight_decay)
        m~  <- lerp(C[code] s_b, g, 1 - beta1);  s_b <- max_b |m~|;  code <- nearest(C, m~ / s_b)
        p   <- p - lr (C[code] s_b / (1 - beta1^t)) / (sqrt(v_b / (1 - beta2^t)) + eps)

    State: 1 byte (8 bits) or 0.5 byte (4 bits) per element plus 8 bytes per block of P (P = 1:
    4 bytes per element for v and 4 per 256 elements for the scale). With
    ``share_second_moment=False, quantize_first_moment=False`` it is ``torch.optim.AdamW``.

    ``factor_second_moment=True`` (not in the paper) scales each block's ``v_b`` per offset j inside
    the block, Adafactor's row-by-column estimate on Gefen's blocks: ``w_j`` is an EMA (beta2) of
    the squared gradient at offset j averaged over the tensor's blocks, and the denominator is
    ``sqrt(v_b w_j / mean(w) / (1 - beta2^t)) + eps``. A tensor of two or more dimensions keeps
    its blocks inside the rows of its matrix view (shape[0], numel / shape[0]): P becomes the
    largest divisor of the row length <= P (``partition.factored_block``), so a block of whole
    rows is one row and the estimate is Adafactor's row-by-column one. A matrix of more rows
    than columns C is factored in tiles of C rows, each with its own w (``partition.factor_tiles``):
    the parts of a fused projection (``nn.MultiheadAttention``'s q, k and v in one weight) do not
    share one column factor. A tensor of fewer than two dimensions (a norm gain, a bias) has no
    columns to factor and keeps one v per element (P = 1, as AdamW's). It costs 4 P bytes per tile
    (at most 4 bytes per row of a tall matrix; plus 8 bytes per block a cut block adds) and 4
    bytes per element of a vector, and helps where squared gradients vary along a block (matrix
    columns) or between the rows a block spanned (embedding rows); with P = 1 it changes nothing.
    ``share_vector_second_moment=True`` gives a vector in a factored group shared v and no w
    instead: the block length of ``partition.choose_block`` (as without the factor) or, where the
    rule finds no block, the whole vector (its largest divisor <= ``partition.MAX_BLOCK``, as
    Gefen-X falls back to one long block), about 1 + 8 / P bytes per element where the
    per-element v costs 5.
    Not for sparse gradients (``nn.Embedding(sparse=True)``: use ``DiskSparseAdam``) nor complex
    parameters. The exact state layout is in ``optim/gefen/reference.py``.

    ``first_moment_rounding="stochastic"`` (not in the paper; Gefen-X offers it) writes each code as
    the lower or upper of the two entries around ``m~ / s_b``, the upper with probability
    ``(m~ / s_b - C[lo]) / (C[hi] - C[lo])``, instead of the nearest: the stored first moment is
    then ``m~`` in expectation, where nearest rounding's error can pile up along a long run in
    the same direction (a small gradient that never moves a code off its entry). Its random bits
    come from ``stochastic_rounding``'s seeds (below) on a stream of their own. Only the torch
    step implements it: "auto" runs those groups on torch, "numba" or "triton" by name is refused.

    ``codebook_refresh_every=N`` (not in the paper; Gefen-X's keyword) learns the codebook again,
    as the first step does, from the gradients of steps 1 + N, 1 + 2N, ... (before they are
    stepped), and re-encodes every stored code to its nearest entry of the new codebook
    (``codebook.code_map``; the scales are unchanged): where the gradients' spread relative to
    their scale block's largest element drifts in training, a codebook fitted to the first
    gradients alone puts the few levels of 4-bit codes where later first moments are not. Whether
    that costs loss depends on the model (results/README.md, "Claims in detail").

    Args:
        params: parameters or param groups (dicts); groups may set ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``share_second_moment``, ``quantize_first_moment``,
            ``factor_second_moment``, ``share_vector_second_moment``, ``share_matrix_rows``,
            ``stochastic_rounding``, ``first_moment_rounding``.
        lr: learning rate: a float, or a one-element tensor that LR schedulers update in place (read
            with ``float`` at each step, which waits for the device where it lives there, unless
            ``capturable``, which reads it on the device). (Default: 1e-3)
        betas: coefficients of the first and second moment averages. (Default: (0.9, 0.999))
        eps: added to the denominator. (Default: 1e-8)
        weight_decay: decoupled weight decay, as AdamW. (Default: 0.0)
        bits: code width of the first moment, 8 (256 levels) or 4 (16 levels, two codes a
            byte). One codebook serves all groups. (Default: 8)
        share_second_moment: one second moment per automatically found block; False keeps one
            per element. (Default: True)
        quantize_first_moment: store the first moment as codes and block scales; False keeps it
            in fp32. (Default: True)
        backend: "torch" (``torch_ops``, any device), "numba" (``numba_ops``, CPU tensors),
            "triton" (``triton_ops``, CUDA tensors, or CPU under ``TRITON_INTERPRET=1``) or "auto"
            (Triton for CUDA tensors, numba on CPU where it is installed, torch otherwise);
            resolved per parameter when it is added (``optim.backends.choose_backend``). Neither
            compiled step keeps float64 moments (float64 parameters in a group with
            ``share_second_moment=False, quantize_first_moment=False``) and Triton takes fp32,
            bf16 and fp16 parameters: "auto" runs those on torch, a compiled backend asked for
            by name is refused. What only the data decide (a codebook numba's table cannot
            separate, a block longer than a Triton program) runs on torch
            (each backend's ``data_refusal``); :meth:`backend_of` tells which path updates a parameter.
            The codebook's histogram is computed with torch on every backend (once per model).
            (Default: "auto")
        fused: upstream's keyword. False is ``backend="torch"``; True or None leave ``backend``
            to choose (upstream's True also falls back to unfused code where its kernels cannot
            run, as ``"auto"`` does). (Default: None)
        verbose: print each tensor's block length when it is chosen (upstream's keyword).
            (Default: False)
        block_rule: "adjacent_log" (upstream's current rule) or "variance_drop" (the paper-era
            rule); see ``partition.py``. (Default: "adjacent_log")
        factor_second_moment: scale each block's second moment per offset inside the block,
            blocks kept inside matrix rows (above; ``reference.py``). False is the published
            algorithm. (Default: False)
        share_vector_second_moment: under ``factor_second_moment``, a tensor of fewer than two
            dimensions (norm gain, bias) shares v in the blocks of the published rule, or in one
            block where the rule finds none, and holds no factor (above), instead of keeping one v
            per element. Decides the state layout, as
            ``factor_second_moment`` does: a state dict restores the saved group's setting (False
            where it was saved before the option). No effect in an unfactored group, whose vectors
            share v by the rule already. (Default: False)
        share_matrix_rows: under ``factor_second_moment``, a tensor of two or more dimensions in
            which the published rule finds no block (P = 1: one v per element, 5 bytes of state a
            parameter) shares v over whole rows of its matrix view instead, times the column factor
            (Adafactor's row-by-column estimate; a position table, for example). The block is chosen
            when the state is made: a state dict keeps it. (Default: False)
        row_group_scales: under ``factor_second_moment``, a matrix keeps one first-moment scale
            per group of whole rows of at most 2,048 elements (Gefen-X's fallback block length),
            not one per row (per block of P): 4 bytes a group instead of a row
            (``partition.row_group_scale_length``; ``state.SCALE_BLOCK``). An int sets that bound
            in elements (a group is never shorter than a block of P), for codes of few levels
            that a long scale block leaves coarse. The scale length is chosen when the state is
            made, as the block is: a state dict keeps it, and a bound changed later applies to new
            states. Every backend (Triton hands blocks of 2 elements, and odd blocks at 4 bits, to
            the torch step). (Default: False)
        whole_matrix_factor: under ``factor_second_moment``, a matrix of more rows than columns
            keeps one column factor w for the whole matrix (Adafactor's, Gefen-X's), not one per
            square tile of rows (above): 4 bytes a column instead of a column per tile, at the cost of
            one factor for the parts of a fused projection. Every backend. (Default: False)
        factor_dtype: "float32" or "bfloat16", the dtype of the factors w (under
            ``factor_second_moment``). bf16 halves their bytes (4 bytes a column a tile -> 2): w is
            updated in fp32 and stored rounded stochastically (``reference.factor_update``), its
            random bits drawn as ``stochastic_rounding``'s are, from each parameter's seed
            (``state.SEED``, then made for fp32 parameters too) mixed with ``plan.FACTOR_STREAM``:
            runs repeat given ``torch.manual_seed`` and a run resumed from a state dict equals the
            uninterrupted one. Decides the state layout, as ``whole_matrix_factor`` does (a state
            dict restores the saved group's setting). Every backend; refused with
            ``capturable=True`` (the seeds come from the host). (Default: "float32")
        stochastic_rounding: write bf16 and fp16 parameters rounded stochastically (up with the
            probability of the fraction of the gap, so exact in expectation) instead of to nearest,
            so updates under half a unit in the last place still move a low-precision weight on
            average: the way to train with bf16 weights and no fp32 master copy. The random bits
            are a hash of each parameter's seed (``state.SEED``, from the optimizer's seed, made at
            its first step from ``torch.initial_seed()`` without drawing from torch's generator,
            the same on every rank, and saved in the state dict), its step and the element
            (``optim._rounding``): runs repeat given ``torch.manual_seed``, a resumed run equals
            the uninterrupted one, and the torch, numba and Triton steps draw the same bits. fp32
            parameters are not affected. ``load_state_dict`` keeps each group's setting: it says
            how this run writes its weights, whatever the checkpoint's run did.
            (Default: False)
        first_moment_rounding: "nearest" (the published rule) or "stochastic": how ``m~ / s_b`` becomes
            a code (above; ``reference.stochastic_round``). The random bits are drawn as
            ``stochastic_rounding``'s are, from each parameter's seed (``state.SEED``, then made for
            fp32 parameters too) mixed with ``plan.CODE_STREAM``, so codes and weights never share
            bits; runs repeat given ``torch.manual_seed`` and a run resumed from a state dict equals
            the uninterrupted one. Refused with ``quantize_first_moment=False`` (nothing to round).
            ``load_state_dict`` keeps each group's setting, as ``stochastic_rounding``'s.
            (Default: "nearest")
        codebook_refresh_every: learn the codebook again every this many steps (above), from the
            gradients of that step; 0 learns it once, at the first step (the published rule). One
            value per optimizer (one codebook serves every group). A refresh step needs every
            gradient at once, as the first step does: under ``step_in_backward`` that backward
            holds them until it ends. Refused with ``capturable=True`` (a captured graph would
            replay the old codebook). Under FSDP2 each step all-reduces one step count, so that
            every rank refreshes at the same step. (Default: 0)
        maximize: maximize the objective (each step is that of -g), as AdamW's. ``p.grad`` is never
            written: each kernel call reads a negated copy of its gradients (shared, expanded and
            ``create_graph`` gradients step as with AdamW). (Default: False)
        capturable: keep each parameter's step count on the device (``state["step"]`` a float32
            tensor, as torch's capturable AdamW keeps it) and compute the bias corrections,
            ``1 - lr*weight_decay`` and the stochastic-rounding seeds there, in one small kernel a
            parameter group a step (``triton_ops.advance_``), so that a step after the first reads
            nothing back to the host and can be captured in a CUDA graph (``torch.cuda.graph``)
            and replayed. ``lr`` may then be a one-element tensor on the parameters' device, read at
            every step and replay (LR schedulers write it in place); a float lr, betas, eps and
            weight decay are baked into a captured graph: changing them needs a new capture, as
            with torch. The first step (block lengths, codebook) and any step that meets a new set
            of tensors build their plan on the host and may synchronise: capture after a few eager
            steps. Every parameter must be on the Triton path (CUDA tensors; CPU tensors under
            ``TRITON_INTERPRET=1``), or it is refused by name. The numbers equal the host's: the
            scalars are computed in float64 and rounded to fp32 once, ``beta**t`` by binary
            powering, within one fp32 ulp of the host's ``pow`` and equal to it at every step the
            tests enumerate. Steps count exactly up to 2**24. State dicts load into an optimizer
            of either setting. (Default: False)
        amsgrad, foreach, differentiable: AdamW's keywords, taken at AdamW's defaults so that a
            configuration written for AdamW runs unchanged; ``foreach`` may be anything (it picks
            among AdamW's implementations), the others are refused when True.

    Every option is also in ``defaults`` and every parameter group (``bits``, ``backend``,
    ``block_rule`` and ``capturable`` one value per optimizer), so re-creating the optimizer from
    ``state_dict()["param_groups"][0]`` gives the same one. The step always runs eagerly
    (``torch.compiler.disable``): under ``torch.compile`` a training step compiles around it.
    """

    OPTIMIZER_WIDE = OPTIMIZER_WIDE
    WIDE_REASON = "one codebook and one backend choice serve every group"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bits=8,
                 share_second_moment=True, quantize_first_moment=True, backend="auto",
                 block_rule="adjacent_log", *, factor_second_moment=False, share_vector_second_moment=False,
                 share_matrix_rows=False, row_group_scales=False, whole_matrix_factor=False,
                 factor_dtype="float32", stochastic_rounding=False,
                 first_moment_rounding="nearest", codebook_refresh_every=0, maximize=False, fused=None,
                 verbose=False, amsgrad=False, foreach=None, capturable=False, differentiable=False):
        check_option("bits", bits, (8, 4), "8 or 4 (an int)")
        check_refresh(codebook_refresh_every, capturable)
        check_option("block_rule", block_rule, RULES, f"one of {RULES}")
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
        self.block_rule = block_rule
        self.codebook_refresh_every = codebook_refresh_every
        self._refreshed_at = None  # the step whose codebook refresh is done (a step's later calls skip it)
        self._codebook = Codebook(bits, histogram)
        # Every option lives in the groups, so a framework that re-creates the optimizer from
        # ``param_groups[0]`` gets this one back; bits, backend and block_rule are one per optimizer.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        share_second_moment=share_second_moment,
                        quantize_first_moment=quantize_first_moment,
                        factor_second_moment=factor_second_moment,
                        share_vector_second_moment=share_vector_second_moment,
                        share_matrix_rows=share_matrix_rows, row_group_scales=row_group_scales,
                        whole_matrix_factor=whole_matrix_factor, factor_dtype=factor_dtype,
                        stochastic_rounding=stochastic_rounding,
                        first_moment_rounding=first_moment_rounding, codebook_refresh_every=codebook_refresh_every,
                        maximize=maximize,
                        bits=bits, backend=self.backend, block_rule=block_rule, capturable=capturable)
        super().__init__(params, defaults)
        self._seed = None  # the optimizer's stochastic-rounding seed, drawn at its first use
        self._drop_plans()

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
        for group in self.param_groups:  # pickled before a keyword existed: its old meaning
            group.setdefault("factor_second_moment", False)
            group.setdefault("share_vector_second_moment", False)
            group.setdefault("share_matrix_rows", False)
            group.setdefault("row_group_scales", False)
            group.setdefault("whole_matrix_factor", False)
            group.setdefault("factor_dtype", "float32")
            group.setdefault("maximize", False)
            group.setdefault("stochastic_rounding", False)
            group.setdefault("first_moment_rounding", "nearest")
            for key in OPTIMIZER_WIDE:
                group.setdefault(key, self.__dict__[key])
        for key in OPTIMIZER_WIDE:
            self.defaults.setdefault(key, self.__dict__[key])
        self.defaults.setdefault("share_vector_second_moment", False)
        self.defaults.setdefault("share_matrix_rows", False)
        self.defaults.setdefault("row_group_scales", False)
        self.defaults.setdefault("whole_matrix_factor", False)
        self.defaults.setdefault("factor_dtype", "float32")
        self.defaults.setdefault("maximize", False)
        self.defaults.setdefault("stochastic_rounding", False)
        self.defaults.setdefault("first_moment_rounding", "nearest")
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

