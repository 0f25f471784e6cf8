"""The small base the optimizers of this package stand on.

It does three things once, so that each optimizer keeps only its own concept:

* torch's state-dict hook protocol: ``state_dict()`` runs the pre-hooks, packs torch's layout (groups
  with parameter indices, state keyed by index) without hooks, hands it to the optimizer's
  ``_pack_state`` and runs the post-hooks on the complete dict; ``load_state_dict()`` runs the
  pre-hooks (a returned dict replaces the argument), the optimizer's ``_unpack_state`` and the
  post-hooks. ``_restore_layout`` is torch's restore of groups and state, for ``_unpack_state``.
* one check of the options that are one per optimizer (``OPTIMIZER_WIDE``): "a group's option must be
  the optimizer's", made when a group is added.
* one per-parameter backend table: a parameter's backend is chosen (``optim.backends.choose_backend``)
  when its group is added (or at its first use, where the optimizer defers it), chosen again at its
  next use after a move to another device or dtype (as torch's optimizers create their state
  lazily), and ``backend_of`` answers from it.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections import defaultdict
from itertools import chain
from typing import NamedTuple

import torch

from ._checks import check_distinct
from ._torch_private import state_dict_hooks
from .backends import choose_backend


def eager(fn):
    """``fn`` run eagerly inside a ``torch.compile``d function (``torch.compiler.disable``), with
    ``torch._dynamo`` (seconds to import) imported only once something has imported it: without it
    nothing compiles, so ``fn`` is called as it is."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)
    return call


class Resolved(NamedTuple):
    """The backend chosen for a parameter, and the device and dtype it was chosen for."""

    backend: str  # "torch", "numba" or "triton"
    device: torch.device
    dtype: torch.dtype


def local_tensor(t):
    """The local shard of a DTensor, the tensor itself otherwise (state lives with the shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


class OptimizerBase(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` with the state-dict protocol, optimizer-wide options and backend
    table above. A subclass sets ``backend`` (the asked-for name) before calling ``__init__`` and
    fills in the template methods: ``_pack_state``, ``_unpack_state``, ``_refusal`` and, where it
    needs them, ``_check_new_group``, ``_check_backends``, ``_group_added``, ``_state_device``,
    ``_path_of`` and ``_resolve`` (to defer a parameter's choice to its first use)."""

    OPTIMIZER_WIDE: tuple = ()  # group options with one value per optimizer
    WIDE_REASON = "one optimizer has one value"  # why, said in the refusal

    def __init__(self, params, defaults):
        self._backends = {}  # param -> Resolved, filled by add_param_group (or at the param's first use)
        super().__init__(params, defaults)

    # ---------------------------------------------------------------------- template methods
    def _pack_state(self, packed: dict) -> dict:
        """The state dict, from torch's packed layout of groups and ``self.state``."""
        return packed

    def _unpack_state(self, state_dict: dict) -> None:
        """Check a state dict (after the pre-hooks) and restore this optimizer from it."""
        raise NotImplementedError

    def _refusal(self, backend: str, p: torch.Tensor, group: dict) -> str | None:
        """Why the concrete ``backend`` cannot update the local tensor ``p`` of ``group`` (None: it can)."""
        return None

    def _check_new_group(self, group: dict, gi: int) -> None:
        """The optimizer's own checks of a group being added (before the optimizer-wide options)."""

    def _check_backends(self, group: dict, gi: int, chosen: dict) -> None:
        """Checks of the backends ``chosen`` ({param: Resolved}) for a group being added."""

    def _group_added(self, group: dict) -> None:
        """Called once a group is added and its backends are chosen."""

    def _state_device(self, p) -> torch.device | None:
        """The device ``p``'s state lives on (None: no state yet, or state that follows ``p``)."""
        return None

    def _path_of(self, p, group: dict, backend: str) -> str:
        """The path that updates ``p`` whose chosen backend is ``backend`` (what ``backend_of`` says)."""
        return backend

    # ---------------------------------------------------------------------------- state dict
    def state_dict(self) -> dict:
        for hook in state_dict_hooks(self, "state_dict_pre"):
            hook(self)
        sd = self._pack_state(self._packed_layout())
        for hook in state_dict_hooks(self, "state_dict_post"):
            out = hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = state_dict.copy()  # shallow, as torch's: a pre-hook may replace entries
        for hook in state_dict_hooks(self, "load_state_dict_pre"):
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        self._unpack_state(state_dict)
        for hook in state_dict_hooks(self, "load_state_dict_post"):
            hook(self)

    def _packed_layout(self) -> dict:
        """torch's ``Optimizer.state_dict`` without its hooks: groups with the indices of their
        parameters (numbered in order of first appearance) and the state keyed by those indices."""
        index = {}
        groups = []
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": [index[id(p)] for p in group["params"]]})
        state = {(index[id(k)] if isinstance(k, torch.Tensor) else k): v for k, v in self.state.items()}
        return {"state": state, "param_groups": groups}

    def _restore_layout(self, state_dict: dict, restore) -> None:
        """torch's ``Optimizer.load_state_dict`` without its hooks: each saved group's options with this
        optimizer's parameters, and each parameter's state as ``restore(p, saved)`` gives it (state
        saved under a key that is no parameter's is kept as it is, as torch does)."""
        groups = self.param_groups
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group "
                             "that doesn't match the size of optimizer's group")
        params = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        state = defaultdict(dict)
        for k, v in state_dict["state"].items():
            if k in params:
                state[params[k]] = restore(params[k], v)
            else:
                state[k] = v
        for g, s in zip(groups, saved_groups):
            s["params"] = g["params"]
            if "param_names" in g and "param_names" not in s:
                s["param_names"] = g["param_names"]
        self.__setstate__({"state": state, "param_groups": saved_groups})

    # ------------------------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        gi, group = len(self.param_groups) - 1, self.param_groups[-1]
        try:
            check_distinct(group["params"], gi, type(self).__name__)
            self._check_new_group(group, gi)
            self._check_optimizer_wide(group, gi)
            chosen = {p: self._resolve(p, group, gi, pi) for pi, p in enumerate(group["params"])}
            self._check_backends(group, gi, chosen)
        except BaseException:
            self.param_groups.pop()  # a refused group is not added
            raise
        self._backends.update((p, r) for p, r in chosen.items() if r is not None)
        self._group_added(group)

    def _check_optimizer_wide(self, group: dict, gi: int) -> None:
        """Each ``OPTIMIZER_WIDE`` option of ``group`` is the optimizer's."""
        for key in self.OPTIMIZER_WIDE:
            if group[key] != self.defaults[key]:
                raise ValueError(f"{type(self).__name__}: group {gi}'s {key} ({group[key]!r}) must be the "
                                 f"optimizer's ({self.defaults[key]!r}): {self.WIDE_REASON}; use a second "
                                 "optimizer for another")

    # ----------------------------------------------------------------------------- backends
    def _resolve(self, p, group: dict, gi: int, pi: int) -> Resolved | None:
        """``choose_backend`` for parameter ``pi`` of group ``gi`` on the device and dtype it has now (an
        override may return None: chosen at the parameter's first use, ``_backend``)."""
        local = local_tensor(p)
        name = choose_backend(
            self.backend, local.device, lambda b: self._refusal(b, local, group), owner=type(self).__name__,
            what=f"parameter {pi} of group {gi} (shape {tuple(p.shape)}, dtype {local.dtype})")
        return Resolved(name, local.device, local.dtype)

    def _resolve_all(self) -> None:
        """Choose every parameter's backend afresh (an unpickled or copied optimizer)."""
        chosen = ((p, self._resolve(p, group, gi, pi)) for gi, group in enumerate(self.param_groups)
                  for pi, p in enumerate(group["params"]))
        self._backends = {p: r for p, r in chosen if r is not None}

    def _backend(self, p, group: dict, gi: int, pi: int) -> str:
        """The backend chosen for ``p``; chosen again for a parameter moved to another device or
        dtype since (as torch's optimizers create their state lazily), unless its state already
        lives on the old device."""
        chosen = self._backends.get(p)
        local = local_tensor(p)
        if chosen is None or chosen.device != local.device or chosen.dtype != local.dtype:
            at = self._state_device(p)
            if chosen is not None and at is not None and at != local.device:
                raise RuntimeError(
                    f"{type(self).__name__}: parameter {pi} of group {gi} (shape {tuple(p.shape)}) is on "
                    f"{local.device}, its state on {at}, where it was at its first step; move parameters "
                    "before the first step, or load the state dict again after moving them")
            try:
                chosen = self._backends[p] = self._resolve(p, group, gi, pi)
            except (RuntimeError, ValueError) as exc:
                if chosen is None:
                    raise
                raise type(exc)(f"{exc} (it was a {chosen.dtype} tensor on {chosen.device} when the optimizer "
                                f"was built, it is a {local.dtype} tensor on {local.device} now)") from exc
        return chosen.backend

    def _position(self, p, caller: str) -> tuple:
        """``(group, gi, pi)``: where parameter ``p`` is; ``caller`` names the public method in the
        refusal of a tensor that is no parameter here."""
        for gi, group in enumerate(self.param_groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    return group, gi, pi
        raise ValueError(f"{type(self).__name__}.{caller}: the tensor (shape {tuple(p.shape)}) is not a "
                         "parameter of this optimizer")

    def backend_of(self, p) -> str:
        """Which path updates ``p``: "torch", "numba" or "triton" (chosen again if ``p`` moved to another
        device or dtype since it was added)."""
        group, gi, pi = self._position(p, "backend_of")
        return self._path_of(p, group, self._backend(p, group, gi, pi))

