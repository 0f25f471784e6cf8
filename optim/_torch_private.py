"""Every use of PyTorch's private APIs in ``optim``, each behind one small function.

A torch upgrade may rename or change any of these; ``tests/test_torch_private.py`` checks each one
on its own, so such a change fails there, named, instead of deep inside an optimizer step. Each
docstring says what the function relies on.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

_HOOK_DICTS = {
    "state_dict_pre": "_optimizer_state_dict_pre_hooks",
    "state_dict_post": "_optimizer_state_dict_post_hooks",
    "load_state_dict_pre": "_optimizer_load_state_dict_pre_hooks",
    "load_state_dict_post": "_optimizer_load_state_dict_post_hooks",
}


def state_dict_hooks(optimizer: torch.optim.Optimizer, kind: str) -> list:
    """The hooks registered with ``optimizer.register_<kind>_hook`` (``kind``: "state_dict_pre",
    "state_dict_post", "load_state_dict_pre" or "load_state_dict_post"), in registration order
    (``prepend=True`` ones first). Relies on ``torch.optim.Optimizer`` keeping each kind in the
    ordered dict ``_optimizer_<kind>_hooks``."""
    return list(getattr(optimizer, _HOOK_DICTS[kind]).values())


def copy_optimizer_hooks(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Give ``target`` a copy of each of ``source``'s hook dicts (step and state-dict hooks), as
    ``copy.deepcopy`` of a torch optimizer gives its copy. Relies on ``torch.optim.Optimizer`` keeping
    them in ordered dicts named ``_optimizer_*_hooks``."""
    for name, hooks in vars(source).items():
        if name.startswith("_optimizer_") and name.endswith("_hooks"):
            setattr(target, name, copy.copy(hooks))


def graph_task_id() -> int:
    """The id of the autograd graph task (one ``backward()``) running now, -1 outside one. Relies on
    ``torch._C._current_graph_task_id``."""
    return torch._C._current_graph_task_id()


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward has finished (inside a backward hook only). Relies on
    ``torch.autograd.Variable._execution_engine.queue_callback``."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def mark_lr_scheduler_wrapped(step: Callable) -> None:
    """Mark a replacement of ``optimizer.step`` as an LR scheduler's own wrapper, so that a scheduler
    neither wraps it again nor warns that ``optimizer.step()`` was not called. Relies on
    ``torch.optim.lr_scheduler`` recognising its wrapper by the attribute ``_wrapped_by_lr_sched``."""
    step._wrapped_by_lr_sched = True


def is_lr_scheduler_wrapped(step: Callable) -> bool:
    """True if ``step`` is an LR scheduler's wrapper of ``optimizer.step`` (see
    :func:`mark_lr_scheduler_wrapped`)."""
    return hasattr(step, "_wrapped_by_lr_sched")


def local_shape_and_offset(dtensor) -> tuple:
    """(local shape, global offset) of this rank's shard of a DTensor, from its global shape, mesh and
    placements. Relies on ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)


def is_dcp_init_step(optimizer: torch.optim.Optimizer, is_zero: Callable[[torch.Tensor], bool]) -> bool:
    """True for the step that ``torch.distributed.checkpoint.state_dict`` takes on an optimizer without
    state to make it create its state (``_init_optim_state``): every group's lr set to 0 and every
    gradient a tensor of zeros (``is_zero``). Relies on that private function's way of doing it."""
    if optimizer.state or any(float(g["lr"]) != 0.0 for g in optimizer.param_groups):
        return False
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return bool(grads) and all(is_zero(g) for g in grads)


def sparse_parts(g: torch.Tensor) -> tuple:
    """(indices, values) of a sparse COO tensor as stored, coalesced or not (duplicates kept, in their
    order), without the copy that coalescing makes; the public ``indices()`` and ``values()`` refuse an
    uncoalesced tensor. Relies on ``Tensor._indices`` and ``Tensor._values``."""
    return g._indices(), g._values()


def version_counter(t: torch.Tensor) -> int:
    """The counter autograd bumps at every in-place change of ``t`` (or of a view of its storage).
    Relies on ``Tensor._version``."""
    return t._version
