"""Memory-light optimizers: Disk Sparse Adam (Euclidean and Poincaré ball) and Gefen.

Public names only. They are imported lazily so that ``import optim`` stays cheap and does not pull
in Triton or the disk-state machinery until an optimizer is actually used.
"""

__all__ = ["DiskSparseAdam", "DiskSparseRiemannianAdam", "Gefen", "GefenLayout", "mapped_embedding", "step_in_backward"]

_WHERE = {
    "DiskSparseAdam": "optim.disk_sparse.optimizer",
    "DiskSparseRiemannianAdam": "optim.disk_sparse.optimizer",
    "Gefen": "optim.gefen.optimizer",
    "GefenLayout": "optim.gefen.layout",
    "mapped_embedding": "optim.disk_sparse.weights",
    "step_in_backward": "optim.backward",
}


def __getattr__(name):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'optim' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
