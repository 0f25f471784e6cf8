"""The peak memory of a training step, without a GPU: live tensor bytes and the process's RSS.

    with PeakMemory(model.parameters(), optimizer) as peak:
        loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()
    peak.tensor_peak          # bytes: weights + gradients + state + the rest, at the peak
    peak.at_peak              # {"weights", "gradients", "state", "rest"}: the peak split
    peak.rss_peak             # bytes the process's resident set rose to above where it started
    rss_bytes(), peak_rss_bytes(), reset_peak_rss()   # the resident set now, its high-water mark, reset it

``tensor_peak`` is what CUDA's ``torch.cuda.max_memory_allocated`` reports for the same step on a
GPU (less the allocator's rounding): the largest sum, at any moment, of the bytes of distinct tensor
storages alive. Storages that exist when the region starts are counted from the ``params`` (their
data and gradients) and the optimizer's state; storages created inside it are seen as the outputs of
the aten operations that make them (a ``TorchDispatchMode``, so backward's and the optimizer's
temporaries are included) and leave the count when they are freed (a weak reference on the storage).
What torch does not allocate is not seen: numpy and numba arrays, the allocator's cache, Python
objects; the RSS beside it sees all of those, and also whatever the allocator keeps after a free.

At the moment of the peak the live bytes are split into the parameters' ``weights``, their
``gradients`` (storages that are some ``p.grad`` then, or were one earlier in the region and are
still alive: set aside, not freed), the optimizer's ``state`` (storages some
tensor of ``optimizer.state`` or a Gefen codebook holds then) and the ``rest`` (activations,
temporaries). ``transient`` is the largest ``rest`` of any moment: memory that is neither data nor
state.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CATEGORIES = ("weights", "gradients", "state", "rest")


def _storage(t):
    """The storage of a dense tensor, None for tensors without one (sparse, meta, wrappers)."""
    if not isinstance(t, torch.Tensor) or t.is_sparse or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _parts(t):
    """The plain tensors that hold ``t``'s bytes: a sparse tensor's indices and values, a tensor
    subclass's inner tensors (a DTensor's local shard, torchao's quantised codes and scales; the
    wrapper's own storage, if it has one, is sized by the shape it presents, not by its bytes)."""
    if t.is_sparse:
        return [t._indices(), t._values()]
    if type(t) not in _PLAIN and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [q for name in names for q in _parts(getattr(t, name))]
    return [t]


def _tensors(obj) -> list:
    """Every plain tensor in nested dicts, lists and tuples, subclasses and sparse tensors by their
    parts (``_parts``). Walked directly, not by a pytree flatten: this runs at every allocation, over
    the optimizer's whole state, and must cost little next to the operation it follows."""
    out, todo = [], [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            if type(x) in _PLAIN and not x.is_sparse:
                out.append(x)
            else:
                out.extend(_parts(x))
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return out


def rss_bytes() -> int:
    """The process's resident set now (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def peak_rss_bytes() -> int:
    """The resident set's high-water mark (bytes; Linux VmHWM, 0 where unknown)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
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
        self._ids = {}  # id(tensor) -> (weakref to it, its data_ptr, id of its storage or None)
        # the storages of weights, gradients and state at the last split, and their bytes still live:
        # a lower bound of the known bytes now (storages made since may have joined them)
        self._known_ids, self._known_lower = set(), 0
        self._grad_ids = set()  # storages seen as some p.grad in the region, while they live

    def _storage_id(self, t):
        """id of ``t``'s storage (None without one), remembered per tensor while the tensor and its
        data pointer stay the same: the split below runs at every allocation."""
        entry = self._ids.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t.data_ptr():
            return entry[2]
        st = _storage(t)
        sid = None if st is None else id(st)
        try:
            self._ids[id(t)] = (weakref.ref(t), t.data_ptr(), sid)
        except (TypeError, RuntimeError):
            pass
        return sid

    def _known(self) -> dict:
        """{category: set of id(storage)} of the weights, gradients and state alive now."""
        ids = self._storage_id
        weights = {ids(p) for p in self.params} - {None}
        # a gradient stays one while it lives, also when set aside from p.grad for a while
        # (step_in_backward steps one parameter at a time with the others' gradients held aside)
        self._grad_ids |= {ids(g) for p in self.params if p.grad is not None for g in _tensors(p.grad)} - {None}
        grads = {k for k in self._grad_ids if k in self._live}
        state = set()
        opt = self.optimizer
        if opt is not None:
            state = {ids(t) for t in _tensors([list(opt.state.values()), getattr(opt, "codebook", None)])} - {None}
        return {"weights": weights, "gradients": grads - weights, "state": state - weights - grads}

    def split(self) -> dict:
        """The bytes counted now, split into the four categories."""
        known = self._known()
        out = {name: sum(self._live[k][1] for k in ids if k in self._live) for name, ids in known.items()}
        self._known_ids = {k for ids in known.values() for k in ids if k in self._live}
        self._known_lower = sum(out.values())
        out["rest"] = self.current - self._known_lower
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
        self._grad_ids.discard(key)
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]
            if key in self._known_ids:
                self._known_ids.discard(key)
                self._known_lower -= entry[1]

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
        if not self._peak_pending and self._at_alloc - self._known_lower <= self.transient:
            return  # the known bytes are at least the bound: this allocation cannot raise the transient
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
        self._rss0 = rss_bytes()
        self._hwm_ok = reset_peak_rss()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._settle()
        hwm = peak_rss_bytes() if self._hwm_ok else rss_bytes()
        self.rss_peak = max(0, hwm - self._rss0)
        return out

    def report(self, num_params: int) -> dict:
        """The peak, its split, the largest transient and the RSS peak, in bytes per parameter."""
        per = float(max(num_params, 1))
        out = {f"{k}_per_param": v / per for k, v in self.at_peak.items()}
        out.update(tensor_peak_per_param=self.tensor_peak / per, transient_per_param=self.transient / per,
                   rss_peak_per_param=self.rss_peak / per)
        return out
