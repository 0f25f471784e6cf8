"""The ``params`` argument of a Disk Sparse optimizer, read once before torch's ``Optimizer`` sees it.

The constructor sizes the state files of all its tables before the first one is made (whether the
state as a whole stays in the page cache decides how each file is mapped: ``StateDir.open_files``),
so it reads ``params`` first; a generator can be read once, so torch then gets the lists read here.
"""

from __future__ import annotations

import torch

from .table import state_bytes


def listed(params):
    """``params`` as a list, and each group's ``"params"`` as a list too (a generator can be read once:
    read here to size the state, it must not reach torch's Optimizer empty). A tensor or a set is left
    for torch's error."""
    if isinstance(params, torch.Tensor):
        return params
    return [dict(item, params=listed(item["params"])) if isinstance(item, dict) and "params" in item
            and not isinstance(item["params"], (torch.Tensor, set)) else item for item in params]


def planned_bytes(params, rule) -> int:
    """The size of the state files of the tables in ``params`` (as ``listed`` gives it)."""
    if isinstance(params, torch.Tensor):
        return 0
    return sum(state_bytes(rule, p) for p in tensors_of(params)
               if isinstance(p, torch.Tensor) and p.dim() in rule.table_dims)


def tensors_of(params):
    """The tensors of a parameter list, of groups (dicts) or of (name, tensor) pairs."""
    for item in params:
        if isinstance(item, dict):
            yield from tensors_of(item.get("params", []) if not isinstance(item.get("params"), torch.Tensor)
                                  else [item["params"]])
        elif isinstance(item, tuple) and len(item) == 2:
            yield item[1]
        else:
            yield item
