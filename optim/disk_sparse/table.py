"""One parameter (one table) of a Disk Sparse optimizer as one record.

:class:`Table` is everything ``base.DiskSparseOptimizer`` keeps per parameter, in one dict
(parameter -> Table): its position, its state file, the layout that file was made for, its weight
file, its step count and its ``routes.Route`` (how it is stepped on the device its weights are
on now). The functions here are what a table's record says about its parameter: the size of its state
file, whether the parameter still fits its files, and the rule's state-dict views of its records.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .routes import Route
from .store import HEADER_BYTES, RowStateFile, spilled_copy
from .weights import WeightFile


@dataclass(eq=False)
class Table:
    """One parameter's record."""

    index: int  # its position among the optimizer's parameters: file param{index:04d}.dsa, named in errors
    store: RowStateFile  # its state file
    layout: tuple  # (dtype, shape) of the weights the state file was made for
    weight_file: WeightFile | None = None  # for weights in a file (``weights.py``)
    step: int = 0  # steps with a gradient (the t of its bias corrections)
    route: Route | None = None  # for the device it was last stepped on (None: not yet, or closed)

    def count_step(self) -> int:
        """Count a step with a gradient (as SparseAdam, also an empty one) and return it; a weight file
        is marked dirty first: its rows are about to change."""
        if self.weight_file is not None:
            self.weight_file.mark_dirty()
        self.step += 1
        return self.step

    def check_usable(self, p, owner: str):
        """Refuse ``p`` where it no longer fits its files: a weight that left its ``mapped_embedding``
        file (its file would no longer see the training), or a dtype or shape changed after the
        state file was made (a cast such as ``module.double()``, or ``p.data = ...``: its records
        were made for the old one, and no kernel may run over buffers of mismatched dtypes or shapes)."""
        k, wf = self.index, self.weight_file
        if wf is not None:
            wf.check_usable()
            if not wf.holds(p) or p.dtype != wf.dtype:
                raise RuntimeError(
                    f"parameter {k}: the weight of the mapped_embedding {wf.path} no longer lives in its file "
                    f"(it is now a {p.dtype} tensor on {p.device}: share_memory(), .to() or a dtype cast "
                    "copied it), so its training would be lost. Keep a mapped weight where it is, or use "
                    "an ordinary nn.Embedding(sparse=True)")
        dtype, shape = self.layout
        if p.dtype != dtype:
            raise RuntimeError(
                f"parameter {k}: its dtype changed from {dtype} to {p.dtype} after {owner} was "
                f"built (a cast such as module.double() or .float()); its state file holds "
                f"{self.store.dtype} records made for {dtype} weights. Cast the table before building "
                "the optimizer, or carry the state over: sd = opt.state_dict(); opt.close(); build a new "
                "optimizer on the cast table and call load_state_dict(sd) (the moments are converted)")
        if tuple(p.shape) != shape:
            raise RuntimeError(
                f"parameter {k}: its shape changed from {shape} to {tuple(p.shape)} after "
                f"{owner} was built (p.data was replaced); its state file holds records for "
                f"{shape[0]} rows. Build a new optimizer for the new table")


def cols(p) -> int:
    """Values per row: a 1-D table is kept as N rows of one value."""
    return p.shape[1] if p.dim() == 2 else 1


def state_bytes(rule, p) -> int:
    """The size of ``p``'s state file under ``rule`` (``rules.Rule``)."""
    esize = torch.empty((), dtype=rule.record_dtype(p.dtype)).element_size()
    return HEADER_BYTES + p.shape[0] * rule.width(cols(p)) * esize


def views(rule, p, records) -> dict:
    """``rule``'s state-dict views of ``p``'s ``records``, of ``p``'s shape (a 1-D table is kept as
    N x 1 records)."""
    out = rule.views(records, cols(p))
    return out if p.dim() == 2 else {k: v.squeeze(1) for k, v in out.items()}


def saved_views(rule, p, store) -> dict:
    """The views ``state_dict`` saves: copy-on-write views of the file (``RowStateFile.private_records``),
    or, where the rule views one record's bytes as several dtypes (``torch.save`` cannot save one
    storage as several dtypes), a copy of each in an unlinked file beside the state file
    (``store.spilled_copy``: page cache, never anonymous memory, so a state dict of a state larger
    than the memory a cgroup leaves free is built and saved within it)."""
    records = store.private_records()
    out = views(rule, p, records)
    if all(v.dtype == records.dtype for v in out.values()):
        return out
    return {k: spilled_copy(v, os.path.dirname(store.path)) for k, v in out.items()}


def meta_message(k) -> str:
    """Why parameter ``k``, still on the meta device, can never be trained, and what to do."""
    return (f"parameter {k} is still on the meta device, so it can never be trained: module.to_empty(device=...) "
            "gives the module new Parameter objects (unless torch.__future__.set_swap_module_params_on_conversion"
            "(True)), and this optimizer holds the old ones. Build the optimizer after module.to_empty(...)")
