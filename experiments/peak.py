"""The peak memory of a training step, without a GPU: live tensor bytes and the process's RSS.

    with PeakMemory(model.parameters(), optimizer) as peak:
        loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()
    peak.tensor_peak          # bytes: weights + gradients + state + the rest, at the peak
    peak.at_peak              # {"weights", "gradients", "state", "rest"}: the peak split
    peak.rss_peak             # bytes the process's resident set rose to above where it started

``tensor_peak`` is what CUDA's ``torch.cuda.max_memory_allocated`` reports for the same step on a
GPU (less the allocator's rounding): the largest sum, at any moment, of the bytes of distinct tensor
storages alive. Storages that exist when the region starts are counted from the ``params`` (their
data and gradients) and the optimizer's state; storages created inside it are seen as the outputs of
the aten operations that make them (a ``TorchDispatchMode``, so backward's and the optimizer's
temporaries are included) and leave the count when they are freed (a weak reference on the storage).
What torch does not allocate is not seen: numpy and numba arrays, the allocator's cache, Python
objects; the RSS beside it sees all of those, and also whatever the allocator keeps after a free.

At the moment of the peak the live bytes are split into the parameters' ``weights``, their
``gradients`` (storages that are some ``p.grad`` then), the optimizer's ``state`` (storages some
tensor of ``optimizer.state`` or a Gefen codebook holds then) and the ``rest`` (activations,
temporaries). ``transient`` is the largest ``rest`` of any moment: memory that is neither data nor
state.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("weights", "gradients", "state", "rest")


def _storage(t):
    """The storage of a dense tensor, None for tensors without one (sparse, meta, wrappers)."""
    if not isinstance(t, torch.Tensor) or t.is_sparse or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _parts(t):
    """The plain tensors that hold ``t``'s bytes: a sparse tensor's indices and values, a tensor
    subclass's inner tensors (a DTensor's local shard, torchao's quantised codes and scales; the
    wrapper's own storage, if it has one, is sized by the shape it presents, not by its bytes)."""
    if t.is_sparse:
        yield t._indices()
        yield t._values()
    elif type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _parts(getattr(t, name))
    else:
        yield t


def _tensors(obj):
    """Every plain tensor in a nested state (dicts, lists, tuples), subclasses and sparse tensors
    by their parts (``_parts``)."""
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            yield from _parts(leaf)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> bool:
    """Reset the resident-set high-water mark to the current RSS (Linux: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_PAGE = 4096
try:
    import os

    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):
    pass


class PeakMemory(TorchDispatchMode):
    """Peak live tensor bytes and peak RSS of the code run inside ``with`` (see module doc).

    ``params``: the model's parameters (their data are ``weights``, their ``.grad`` the
    ``gradients``); ``optimizer``: any ``torch.optim.Optimizer`` (its ``state`` is ``state``) or
    None. Both are read again whenever the live bytes grow, so state and gradients created inside
    the region are counted where they belong. ``transient`` (bytes) is the largest ``rest`` seen.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile'd code (torchao's optimizer steps) compiles with the mode off and runs
        with it on; a non-ignoring mode makes ``torch.compile(fullgraph=True)`` refuse to run.
        What a compiled graph allocates and frees inside itself is not seen; its outputs are."""
        return True

    def __init__(self, params=(), optimizer=None):
        super().__init__()
        self.params = list(params)
        self.optimizer = optimizer
        self._live = {}  # id(storage) -> (weakref, nbytes) of every storage counted
        self.current = 0
        self.tensor_peak = 0
        self.at_peak = dict.fromkeys(CATEGORIES, 0)
        self.transient = 0
        self.rss_peak = 0
        self._rss0 = 0
        self._hwm_ok = False
        self._pending = self._peak_pending = False
        self._at_alloc = 0

    def _known(self) -> dict:
        """{category: set of id(storage)} of the weights, gradients and state alive now."""
        weights = {id(s) for s in map(_storage, self.params) if s is not None}
        grads = set()
        for p in self.params:
            if p.grad is not None:
                grads.update(id(s) for s in map(_storage, _tensors(p.grad)) if s is not None)
        state = set()
        opt = self.optimizer
        if opt is not None:
            held = [list(opt.state.values()), getattr(opt, "codebook", None)]
            state = {id(s) for s in map(_storage, _tensors(held)) if s is not None}
        return {"weights": weights, "gradients": grads - weights, "state": state - weights - grads}

    def split(self) -> dict:
        """The bytes counted now, split into the four categories."""
        out = {name: sum(self._live[k][1] for k in ids if k in self._live)
               for name, ids in self._known().items()}
        out["rest"] = self.current - sum(out.values())
        return out

    def _count(self, st):
        key = id(st)
        if key in self._live:
            return False
        n = st.nbytes()
        self._live[key] = (weakref.ref(st, lambda _, key=key: self._freed(key)), n)
        self.current += n
        return n > 0

    def _freed(self, key):
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._settle()
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            st = _storage(t)
            if st is not None and self._count(st):
                self._pending = True
                self._at_alloc = self.current
                if self.current > self.tensor_peak:
                    self.tensor_peak, self._peak_pending = self.current, True
        return out

    def _settle(self):
        """Split the live bytes after an allocation, at the next operation (or the region's end):
        by then the new tensor has been stored where it belongs (``state[p]["v"] = torch.zeros(..)``
        is state, not a transient, though it is allocated before it is stored). What was freed
        in between was part of the rest then: the rest is the bytes live after the allocation less
        the data and state live now."""
        if not self._pending:
            return
        self._pending = False
        now = self.split()
        known = now["weights"] + now["gradients"] + now["state"]
        self.transient = max(self.transient, self._at_alloc - known)
        if self._peak_pending:
            self._peak_pending = False
            now["rest"] = max(0, self.tensor_peak - now["weights"] - now["gradients"] - now["state"])
            self.at_peak = now

    def __enter__(self):
        for p in self.params:  # the storages that exist already: data, gradients, state
            for t in _tensors([p, p.grad]):
                st = _storage(t)
                if st is not None:
                    self._count(st)
        opt = self.optimizer
        if opt is not None:
            for st in map(_storage, _tensors([list(opt.state.values()), getattr(opt, "codebook", None)])):
                if st is not None:
                    self._count(st)
        self._pending = self._peak_pending = False
        self._at_alloc = 0
        self.tensor_peak = self.current
        self.at_peak = self.split()
        self.transient = self.at_peak["rest"]
        self._rss0 = _rss()
        self._hwm_ok = _reset_hwm()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._settle()
        hwm = _hwm() if self._hwm_ok else _rss()
        self.rss_peak = max(0, hwm - self._rss0)
        return out

    def report(self, num_params: int) -> dict:
        """The peak, its split, the largest transient and the RSS peak, in bytes per parameter."""
        per = float(max(num_params, 1))
        out = {f"{k}_per_param": v / per for k, v in self.at_peak.items()}
        out.update(tensor_peak_per_param=self.tensor_peak / per, transient_per_param=self.transient / per,
                   rss_peak_per_param=self.rss_peak / per)
        return out
