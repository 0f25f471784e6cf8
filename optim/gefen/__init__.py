"""Gefen: AdamW with about one byte of state per parameter (arXiv 2606.13894)."""

__all__ = ["Gefen", "GefenLayout", "layout_of"]


def __getattr__(name):
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("optim.gefen.optimizer" if name == "Gefen" else "optim.gefen.layout"),
                       name)
    raise AttributeError(f"module 'optim.gefen' has no attribute {name!r}")
