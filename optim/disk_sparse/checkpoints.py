"""Checkpoints of a Disk Sparse optimizer: its state dict, built from the state files; a loaded one,
checked whole before anything is written into them; and the copy ``deepcopy`` makes.

``state_dict()`` holds step and moments of every parameter that has state (a step, a load or a
resumed file: as SparseAdam, none before). The moments are built then, as copy-on-write views of
the files, or where the rule views one record's bytes as several dtypes, as the compact format does
(``torch.save`` cannot save one storage as several dtypes), as copies in unlinked files in the
state_dir (``store.spilled_copy``), which go with the state dict (``table.saved_views``).
``torch.save`` streams them from the files without a copy in anonymous memory, so a state larger
than the memory limit saves within it. Until a later step writes a row, the views show the file as
it is (save before stepping again); what another optimizer that loads them
(``torch.optim.SparseAdam``) writes stays in its private pages and never reaches the files
(``RowStateFile.private_records``).

``load_state_dict`` takes state dicts of the optimizer or of ``torch.optim.SparseAdam`` (same keys);
parameters absent from its ``state`` get fresh (zero) state. The whole state dict is checked (groups,
parameters, keys, shapes, dtypes, steps: ``checks.py``) before anything is written, so a bad one
leaves every file as it was; ``StateDir.restore`` then marks every table dirty before writing any
(a load cut short leaves a directory that is refused on reopening, never one at mixed steps) and
writes the rows in chunks, so ``load_state_dict(torch.load(path, mmap=True))`` restores a state
larger than memory.
"""

from __future__ import annotations

import contextlib
import copy

from .._torch_private import copy_optimizer_hooks
from .checks import loaded_columns, loaded_groups, saved_state_by_param
from .state import STEP
from .table import saved_views, views


@contextlib.contextmanager
def moments_in_state(rule, tables: dict, state, every_param: bool):
    """``state`` (the optimizer's ``state``, which torch packs and its state-dict hooks see) with each
    table's step and moments as a state dict saves them, for each parameter of ``tables``
    ({parameter: ``table.Table``}) that has an entry (``every_param``: for all), while the block runs;
    afterwards the steps alone again, and no entry where there was none."""
    live = {p: state[p] for p in tables if p in state}
    try:
        for p, table in tables.items():
            if p in live or every_param:
                state[p] = {STEP: table.step, **saved_views(rule, p, table.store)}
        yield
    finally:
        for p in tables:
            state.pop(p, None)
        state.update(live)


def checked_load(rule, tables: dict, param_groups: list, state_dict: dict, kept) -> tuple:
    """What ``state_dict`` loads, all checked: ({parameter: (its record columns or None for fresh
    state, its step)}, the groups' options), the options in ``kept`` (the files') keeping the
    optimizer's values."""
    saved = saved_state_by_param(param_groups, state_dict)
    loaded = {p: loaded_columns(views(rule, p, t.store.records), saved.get(p),
                                f"state_dict's state of parameter {t.index}", rule)
              for p, t in tables.items()}
    return loaded, loaded_groups(state_dict, param_groups, rule, kept=kept)


def twin(opt, memo: dict, private: bool):
    """``copy.deepcopy(opt)``: the same optimizer class over deep copies of the parameters, made from
    its options (so in a new private state_dir), holding a copy of ``opt``'s state and its step and
    state-dict hooks (as deepcopy gives SparseAdam's). Refused unless ``opt``'s state_dir is
    ``private``: two optimizers cannot share a fixed one."""
    if not private:
        raise RuntimeError(f"cannot deepcopy {type(opt).__name__} on the fixed state_dir {opt.state_dir}: "
                           "two optimizers cannot share it. Create one on another state_dir and "
                           "load_state_dict(opt.state_dict()) into it")
    groups = [{k: copy.deepcopy(v, memo) for k, v in g.items()} for g in opt.param_groups]
    new = memo[id(opt)] = type(opt)(groups, **copy.deepcopy(opt.defaults, memo))
    new.load_state_dict(opt.state_dict())
    copy_optimizer_hooks(opt, new)
    return new
