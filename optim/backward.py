"""The optimizer step fused into backward: each parameter is updated as soon as its gradient is
complete, and its gradient freed there, so a full set of gradients is never held.

    handle = step_in_backward(optimizer)
    for x, y in batches:
        loss_fn(model(x), y).backward()   # every parameter is updated (and its gradient freed) here
        scheduler.step()                   # LR schedulers work as in the ordinary loop
    handle.remove()                        # or: with step_in_backward(optimizer): ...

This is PyTorch's recipe "How to save memory by fusing the optimizer step into the backward pass"
(``torch.Tensor.register_post_accumulate_grad_hook``) with one optimizer for the whole model: in
``p``'s hook, ``p`` is the only parameter with a gradient that the optimizer's own ``step()`` sees.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref

import torch

from ._torch_private import at_backward_end, graph_task_id, is_lr_scheduler_wrapped, mark_lr_scheduler_wrapped

__all__ = ["step_in_backward", "StepInBackward"]

# optimizer -> weak reference to its installed StepInBackward. Both weak: a model and optimizer
# dropped with the handle still installed are collected, and their handle stops counting.
_ACTIVE = weakref.WeakKeyDictionary()


def _installed(optimizer) -> "StepInBackward | None":
    ref = _ACTIVE.get(optimizer)
    return None if ref is None else ref()


def _handles() -> list:
    """The installed handles that are alive."""
    return [h for h in (ref() for ref in list(_ACTIVE.values())) if h is not None]


def step_in_backward(optimizer: torch.optim.Optimizer, *, local_gradients: bool = False) -> "StepInBackward":
    """Run ``optimizer``'s update of each parameter inside backward, in the parameter's
    post-accumulate-grad hook, and free the gradient there; returns a handle whose ``remove()``
    undoes it (also a context manager).

    Each backward is then one optimizer step: the loop is ``loss.backward()`` (then
    ``scheduler.step()`` if there is one), with no ``optimizer.step()`` and no ``zero_grad()``.
    Every parameter's result is the ordinary loop's (``backward(); step(); zero_grad()``) for any
    ``torch.optim.Optimizer`` whose step touches only the parameters that have a gradient and
    treats each on its own (torch's AdamW, Adam, SGD; ``Gefen``, ``DiskSparseAdam``,
    ``DiskSparseRiemannianAdam``), at the cost of the gradient memory: at most one parameter's
    gradient is alive at a time, instead of all of them.

    How: in ``p``'s hook, any other parameter's gradient is set aside (normally there is none:
    the others' are freed by their own hooks or not computed yet), the optimizer's own ``step()``
    runs, the others are put back and ``p.grad`` is set to None. That look at the other
    parameters, and the optimizer's own walk over its param groups, cost O(number of parameter
    tensors) per hook, so O(P²) Python work per backward: small next to the update for models of
    hundreds of tensors; for many thousands, group them into fewer tensors. The optimizer's step
    hooks (``register_step_pre_hook`` / ``post_hook``) run once per parameter.

    An optimizer that must see every gradient at once says so with a ``needs_every_gradient()``
    method (``Gefen`` before its model-wide codebook exists, that is at its first step). While it
    returns True at the start of a backward, the hooks neither step nor free: that one step holds
    every gradient, as the ordinary loop does, and runs when the backward ends. An optimizer with
    a ``learn_from_gradients()`` method (``Gefen``: the codebook) learns there what it needs from
    all of them without stepping; if ``needs_every_gradient()`` is then False, each parameter is
    stepped on its own and its gradient freed at once, so that step's new state and temporaries
    come one parameter at a time beside the gradients; otherwise the step runs as one ordinary
    ``optimizer.step()``. Then the gradients are freed.

    LR schedulers: ``scheduler.step()`` after each backward changes the learning rate the next
    backward's hooks use, as in the ordinary loop, created before or after this call.

    A wrapper that holds the optimizer as ``.optimizer`` (accelerate's ``AcceleratedOptimizer``)
    is unwrapped: the hooks run the wrapped optimizer's own step (``handle.optimizer``).

    Frozen parameters: those with ``requires_grad=False`` or that are not leaves when this is
    called are not hooked; one unfrozen later (``requires_grad_(True)``, a fine-tuning schedule)
    is hooked at the next backward that reaches a hooked parameter, and stepped in it (at the end
    of that backward where its gradient came before any hook ran), as in the ordinary loop. Groups
    that ``add_param_group`` adds are hooked at once.

    An exception inside a backward (in a hook, or in any op's backward) leaves each parameter
    whole: those stepped before it keep their step (in backward order, the ones nearest the loss),
    the others keep their weights and state; the failed backward's gradients are dropped (a held
    first step is not taken: nothing was stepped), at the latest when the next backward starts,
    which is then an ordinary step.

    Refused, with an error saying why and what to do instead:

    - calling ``optimizer.step()`` yourself (each backward has stepped already), and
      ``step(closure)``;
    - ``torch.amp.GradScaler``: ``scaler.scale(loss)`` is refused while a step runs in backward
      (before any parameter is stepped). The scaler must see every gradient before the step, to
      unscale them and skip the step on inf or NaN; a step inside backward cannot wait for that
      (PyTorch's optimizer-in-backward recipe and FlashOptim's gradient release do not combine
      with it either). Use bf16 autocast, which needs no scaler, or the ordinary loop;
    - ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` over hooked parameters: their
      gradients were stepped and freed in backward (the norm would be 0, nothing clipped). Clip
      each parameter's gradient on its own with a ``p.register_post_accumulate_grad_hook``
      registered before this call (hooks run in order), or use the ordinary loop;
    - gradient accumulation: a parameter that already has a gradient when backward reaches it
      (from a backward before this call, from ``zero_grad(set_to_none=False)``, set by hand), so
      that this backward's gradient would be added to it. A hook cannot fire twice in one backward
      (torch accumulates each leaf's gradient once per backward), and several backwards before one
      step cannot be told apart from several steps: each backward steps, and an accumulation
      loop's ``optimizer.step()`` is refused the first time it runs; inside accelerate's
      ``accumulate()`` the first micro-batch's backward is refused, before any step;
    - DDP (plain tensor parameters while a process group of several ranks is initialised, at this
      call and at each backward): a hook would step on the rank's local gradient, before
      DistributedDataParallel's all-reduce, and the replicas would drift apart. FSDP2
      (``fully_shard``, DTensor parameters) is supported: its hooks run on the reduce-scattered
      gradient. ``local_gradients=True`` says the parameters are meant to be stepped on each rank's
      own gradient (no data parallelism over them) and skips this check;
    - parameters on the meta device (build the optimizer after the model is materialised);
    - installing twice on one optimizer.

    Not detectable, so not refused; these give results other than the ordinary loop's:

    - reentrant activation checkpointing (``use_reentrant=True``) runs nested backwards, each of
      which ends (and runs a held step) on its own: use ``use_reentrant=False``;
    - an optimizer whose step couples parameters (a norm or trust ratio over all of them, LBFGS).
    """
    optimizer = _unwrap(optimizer)
    if _installed(optimizer) is not None:
        raise RuntimeError(
            f"step_in_backward: the steps of this {type(optimizer).__name__} already run in "
            "backward; call remove() on the handle the first call returned before installing again")
    return StepInBackward(optimizer, local_gradients=local_gradients)


def _unwrap(optimizer):
    """The optimizer that steps: ``optimizer``, or the one a wrapper holds as ``.optimizer``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"step_in_backward expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    seen = {id(optimizer)}
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer) and id(inner) not in seen:
        optimizer = inner
        seen.add(id(inner))
        inner = getattr(optimizer, "optimizer", None)
    return optimizer


def _hooked(params) -> bool:
    """True if a parameter of ``params`` is stepped inside backward by an installed handle."""
    return any(p in h._hooks for h in _handles() for p in params)


def _refuse_scaler(scale):
    @functools.wraps(scale)
    def scale_unless_stepped_in_backward(self, outputs):
        if self.is_enabled() and _handles():
            raise RuntimeError(
                "torch.amp.GradScaler cannot be used while step_in_backward is installed: the scaler "
                "must see every gradient before the step (to unscale them and skip the step on inf or "
                "NaN), and each parameter is stepped inside backward as soon as its gradient is "
                "complete. Use bf16 autocast (torch.autocast(device_type, dtype=torch.bfloat16)), which "
                "needs no scaler, or remove() the handle and step in the ordinary loop")
        return scale(self, outputs)
    return scale_unless_stepped_in_backward


def _refuse_clip(clip):
    @functools.wraps(clip)
    def clip_unless_stepped_in_backward(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _ACTIVE and _hooked(params):
            raise RuntimeError(
                f"torch.nn.utils.{clip.__name__} over parameters stepped inside backward "
                "(step_in_backward): their gradients were stepped and freed in backward, so it would "
                "clip nothing (the norm would be 0). Clip each parameter's gradient on its own in a "
                "p.register_post_accumulate_grad_hook registered before step_in_backward, or remove() "
                "the handle and clip in the ordinary loop")
        return clip(params, *args, **kwargs)
    return clip_unless_stepped_in_backward


# (owner, name) -> torch's own function, while a guard stands in for it (only while a handle is installed)
_GUARDED: dict = {}


def _guard_torch() -> None:
    """While a handle is installed, ``GradScaler.scale`` and gradient clipping refuse where a step runs
    in backward (and pass through otherwise). torch's own functions come back when the last handle is
    removed (``_unguard_if_idle``): nothing of torch stays replaced."""
    if _GUARDED:
        return
    from torch.nn.utils import clip_grad
    targets = [(torch.amp.GradScaler, "scale", _refuse_scaler)]
    targets += [(owner, name, _refuse_clip) for name in ("clip_grad_norm_", "clip_grad_value_")
                for owner in (clip_grad, torch.nn.utils)]
    guards = {}  # one guard per original, where two modules export the same function
    for owner, name, make in targets:
        original = owner.__dict__[name]
        guard = guards.setdefault(id(original), make(original))
        _GUARDED[(owner, name)] = (original, guard)
        setattr(owner, name, guard)


def _unguard_if_idle() -> None:
    """Give torch its functions back once no handle is installed (a guard that someone replaced since
    stays under their function, passing calls through)."""
    if _handles():
        return
    for (owner, name), (original, guard) in list(_GUARDED.items()):
        if owner.__dict__.get(name) is guard:
            setattr(owner, name, original)
    _GUARDED.clear()


def _accumulating() -> bool:
    """True inside accelerate's ``accumulate()`` on a micro-batch that is not to step (its public
    ``GradientState().sync_gradients`` is False); False where accelerate is not in use."""
    state = sys.modules.get("accelerate.state")
    gradient_state = getattr(state, "GradientState", None)
    return gradient_state is not None and gradient_state().sync_gradients is False


def _distributed_replicas(params) -> bool:
    """True where a process group of several ranks is initialised and a parameter is a plain
    tensor (DDP's replicas), not a DTensor (FSDP2's shards)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return any(not hasattr(p, "device_mesh") for p in params)


class _Backward:
    """One backward (autograd graph task) seen by the hooks: whether it holds its step, whose
    gradients it holds, and the parameters hooked while it ran (unfrozen since the last one)."""

    __slots__ = ("held", "fired", "late")

    def __init__(self, held: bool):
        self.held = held
        self.fired = set()  # id(p) of the parameters whose gradient a held backward keeps
        self.late = []  # parameters hooked by this backward's first hook


class StepInBackward:
    """The handle :func:`step_in_backward` returns: ``remove()`` (idempotent) undoes it; as a
    context manager, leaving the block removes it."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, local_gradients: bool = False):
        self.optimizer = optimizer
        self._local_gradients = local_gradients
        self._hooks = {}  # p -> (pre-accumulate handle, post-accumulate handle)
        self._task, self._backward = None, None  # the graph task the hooks last ran in, and its entry
        self._inside = False  # True while a hook runs the optimizer's own step
        self._removed = False
        self._step = optimizer.step  # what `optimizer.step` was: the class's, or a wrapper (LR scheduler)
        self._had_step = "step" in optimizer.__dict__
        self._add = optimizer.add_param_group
        self._had_add = "add_param_group" in optimizer.__dict__

        def guarded_step(opt, *args, **kwargs):
            return self._guarded_step(*args, **kwargs)

        if is_lr_scheduler_wrapped(self._step):
            # An LR scheduler's mark: a scheduler warns at its first step where it is gone, and
            # wraps (again) a step that lacks it.
            mark_lr_scheduler_wrapped(guarded_step)

        def add_param_group(opt, param_group):
            out = self._add(param_group)
            if not self._removed:
                self._hook_new()
            return out

        self._guard = types.MethodType(guarded_step, optimizer)
        self._add_guard = types.MethodType(add_param_group, optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        meta = [tuple(p.shape) for p in params if p.is_meta]
        if meta:
            raise RuntimeError(
                f"step_in_backward: {len(meta)} parameters of the {type(optimizer).__name__} are on the meta "
                f"device (shapes {meta[:3]}...), holding no data; materialise the model "
                "(module.to_empty(...)) and build the optimizer after it")
        self._check_distributed(params)
        _ACTIVE[optimizer] = weakref.ref(self)
        _guard_torch()
        weakref.finalize(self, _unguard_if_idle)  # a handle collected without remove()
        try:
            self._hook_new()
        except BaseException:
            self.remove()
            raise
        optimizer.step = self._guard
        optimizer.add_param_group = self._add_guard

    # ------------------------------------------------------------------------------ handle
    def remove(self) -> None:
        """Remove the hooks and give ``optimizer.step`` back; a second call does nothing."""
        if self._removed:
            return
        self._removed = True
        for pre, post in self._hooks.values():
            pre.remove()
            post.remove()
        self._hooks.clear()
        opt = self.optimizer
        # Put back what was there, unless someone wrapped it since (an LR scheduler made after
        # step_in_backward): then the guard stays under the wrapper and only passes calls through.
        for name, guard, had, original in (("step", self._guard, self._had_step, self._step),
                                           ("add_param_group", self._add_guard, self._had_add, self._add)):
            if opt.__dict__.get(name) is guard:
                if had:
                    setattr(opt, name, original)
                else:
                    del opt.__dict__[name]
        if _installed(opt) is self:
            del _ACTIVE[opt]
        _unguard_if_idle()

    def __enter__(self) -> "StepInBackward":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------------------------- steps
    def _guarded_step(self, *args, **kwargs):
        if self._removed:
            return self._step(*args, **kwargs)
        name = type(self.optimizer).__name__
        if (args and args[0] is not None) or kwargs.get("closure") is not None:
            raise RuntimeError(
                f"{name}.step(closure): under step_in_backward each parameter is stepped inside "
                "backward, so a closure cannot be re-evaluated; call loss.backward() instead, or "
                "remove() the handle first")
        if not self._inside:
            raise RuntimeError(
                f"{name}.step() was called while step_in_backward is installed: each parameter "
                "is stepped inside backward already, so the loop is loss.backward() alone (no "
                "optimizer.step(), no zero_grad()). Gradient accumulation over several backwards is "
                "not possible with it (each backward has been one step): use the ordinary loop for "
                "that; call remove() on the handle to step by hand again")
        return self._step(*args, **kwargs)

    def _run_step(self, keep, method="step"):
        """The optimizer's own step (or its ``method``) over the gradients of the parameters in
        ``keep`` (ids): every other parameter's gradient is set aside meanwhile and put back after."""
        aside = [(q, q.grad) for g in self.optimizer.param_groups for q in g["params"]
                 if q.grad is not None and id(q) not in keep]
        for q, _ in aside:
            q.grad = None
        self._inside = True
        try:
            getattr(self.optimizer, method)()  # the current attribute: wrappers made after this call run too
        finally:
            self._inside = False
            for q, grad in aside:
                q.grad = grad

    # ------------------------------------------------------------------------------- hooks
    def _check_distributed(self, params):
        if not self._local_gradients and _distributed_replicas(params):
            raise RuntimeError(
                "step_in_backward under DistributedDataParallel (a process group of several ranks and "
                "plain tensor parameters): each hook would step on this rank's local gradient, before "
                "DDP's all-reduce, and the replicas would drift apart. Use the ordinary loop under DDP, "
                "or FSDP2 (torch.distributed.fsdp.fully_shard), whose hooks run on the reduce-scattered "
                "gradient; pass local_gradients=True if each rank is meant to step on its own gradient")

    def _hook_new(self) -> list:
        """Hook the optimizer's trainable leaf parameters that have no hooks yet; returns them.
        The hooks hold the handle weakly: a tensor's hooks live in C++, out of the garbage
        collector's sight, and would keep the handle, its optimizer and model alive for good."""
        new = []
        me = weakref.ref(self)

        def after(p):
            handle = me()
            if handle is not None:
                handle._after_hook(p)

        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p in self._hooks or not p.requires_grad or not p.is_leaf:
                    continue
                self._hooks[p] = (p.register_hook(_before_hook(me, weakref.ref(p))),
                                  p.register_post_accumulate_grad_hook(after))
                new.append(p)
        return new

    def _entry(self):
        """The entry of the backward running now; made (and its end queued) by its first hook,
        which also hooks the parameters unfrozen since the last backward and drops what a backward
        that raised left behind."""
        task = graph_task_id()
        if task != self._task or self._backward is None:
            if self._backward is not None:  # a backward that raised: its end never ran
                self._drop(self._backward)
            needs = getattr(self.optimizer, "needs_every_gradient", None)
            entry = _Backward(held=bool(needs()) if callable(needs) else False)
            self._task, self._backward = task, entry
            at_backward_end(lambda: self._end(entry))
            if _accumulating():
                raise RuntimeError(
                    "step_in_backward inside accelerate's accumulate() on a micro-batch that should not "
                    "step: under step_in_backward every backward is one optimizer step, so gradients "
                    "cannot be accumulated over micro-batches; use the ordinary loop (or "
                    "gradient_accumulation_steps=1)")
            entry.late = self._hook_new()
            self._check_distributed(self._hooks)
        return self._backward

    def _drop(self, entry):
        """Free the gradients a backward that raised left on its parameters (held for its step,
        or reached before their hooks existed): that backward is not a step."""
        for p in list(self._hooks):
            if id(p) in entry.fired or any(p is q for q in entry.late):
                p.grad = None

    def _after_hook(self, p):
        if p.grad is None:  # consumed by another hook (a parameter shared with another optimizer)
            return
        entry = self._entry()
        if entry.held:
            entry.fired.add(id(p))
            return  # stepped with all the others when this backward ends
        try:
            self._run_step({id(p)})
        finally:  # stepped, or refused: this backward's gradient is not added to by the next
            p.grad = None

    def _end(self, entry):
        """Queued by a backward's first hook: the held step, where there is one, and the steps of
        parameters unfrozen since the last backward whose gradient came before their hook."""
        if self._backward is entry:
            self._task, self._backward = None, None
        early = [p for p in entry.late if p.grad is not None and id(p) not in entry.fired]
        if not entry.held:
            for p in early:
                try:
                    self._run_step({id(p)})
                finally:
                    p.grad = None
            return
        entry.fired.update(id(p) for p in early)
        held = [q for g in self.optimizer.param_groups for q in g["params"] if id(q) in entry.fired]
        try:
            if callable(getattr(self.optimizer, "learn_from_gradients", None)):
                self._run_step(entry.fired, "learn_from_gradients")
            if self.optimizer.needs_every_gradient():
                self._run_step(entry.fired)
                return
            for q in held:  # learned: each on its own, its gradient freed at once
                if q.grad is not None:
                    try:
                        self._run_step({id(q)})
                    finally:
                        q.grad = None
        finally:
            for q in held:
                q.grad = None


def _before_hook(me, ref):
    """The hook that runs before a gradient is accumulated into ``p.grad`` (``ref``: weak, as
    ``me``, the handle): refuses adding to a gradient already there."""
    def before(grad):
        handle, p = me(), ref()
        if handle is None or p is None or p.grad is None:
            return
        handle._entry()  # drops what a backward that raised left, if that is where it came from
        if p.grad is not None:
            raise RuntimeError(
                f"step_in_backward: a parameter of shape {tuple(p.shape)} already has a gradient "
                "when backward reaches it; this backward's would be added to it (gradient "
                "accumulation), which step_in_backward does not support: each backward is one "
                "step. Call optimizer.zero_grad() (set_to_none=True) before the first backward "
                "with step_in_backward")
    return before
