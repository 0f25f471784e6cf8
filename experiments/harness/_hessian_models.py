"""Tiny models whose full Hessian fits on a CPU, their data, and the Hessian itself.

Used by ``experiments/hessian_alignment.py``. Everything works on one flat parameter vector, so the
Hessian is an ordinary ``n x n`` matrix and every block scheme is a vector of block ids.

- Data: Python's documentation topics (experiments/harness/data.py), characters mapped to the ``vocab - 1`` most frequent ones plus one "other" symbol; the first 90 % is
  the training split, the rest the validation split.
- Models (experiments/harness/models.py): ``TinyCharTransformer`` and ``CharMLP``, built by ``build_model``.
- ``hessian``: forward-over-reverse Hessian-vector products (``torch.func.jvp`` of ``torch.func.grad``)
  against the identity, vmapped in chunks, float64.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp, vmap

from experiments.harness import data
from experiments.harness.models import CharMLP, TinyCharTransformer


# ----------------------------------------------------------------------------------------- data
def load_text_ids(vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Python's documentation topics as character ids: (train ids, validation ids, symbols).

    Symbol ``vocab - 1`` stands for every character outside the ``vocab - 1`` most frequent ones.
    """
    ids, symbols = data.frequent_char_ids(data.documentation_text(), vocab)
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:], symbols


def sample_batch(ids: torch.Tensor, batch: int, length: int, gen: torch.Generator):
    """``batch`` random windows: inputs [batch, length] and next-character targets [batch, length]."""
    start = torch.randint(0, len(ids) - length - 1, (batch,), generator=gen)
    idx = start[:, None] + torch.arange(length + 1)
    w = ids[idx]
    return w[:, :-1], w[:, 1:]


# --------------------------------------------------------------------------------------- models
def build_model(kind: str, vocab: int, size: dict, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "transformer":
        return TinyCharTransformer(vocab, size["ctx"], size["d_model"], size["n_heads"], size["d_ff"])
    if kind == "mlp":
        return CharMLP(vocab, size["context"], size["hidden"])
    raise ValueError(f"model kind {kind!r}: expected 'transformer' or 'mlp'")


# ---------------------------------------------------------------------------- flat parameters
class FlatModel:
    """A module seen as a function of one flat parameter vector (float32 or float64)."""

    def __init__(self, module: nn.Module):
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.offsets = [0]
        for k in self.numels:
            self.offsets.append(self.offsets[-1] + k)
        self.n = self.offsets[-1]

    def initial(self, dtype=torch.float32) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.module.parameters()]).to(dtype)

    def tensor_slices(self):
        """(name, shape, slice into the flat vector) per parameter tensor."""
        return [(n, s, slice(a, b)) for n, s, a, b in zip(self.names, self.shapes, self.offsets, self.offsets[1:])]

    def unflatten(self, flat: torch.Tensor) -> dict:
        return {n: flat[sl].view(s) for n, s, sl in self.tensor_slices()}

    def loss(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(self.module, self.unflatten(flat), (x,))
        if getattr(self.module, "kind", "") == "mlp":
            y = y[:, self.module.context - 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def minibatch_grads(fm: FlatModel, flat: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Gradient of the loss on each minibatch: xs, ys [K, batch, length] -> [K, n]."""
    return vmap(grad(fm.loss), in_dims=(None, 0, 0))(flat, xs, ys)


def hessian(fm: FlatModel, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Full Hessian of the mean loss on (x, y) at ``flat``: jvp of the gradient against each basis
    vector (forward over reverse), vmapped ``chunk`` columns at a time; symmetrised."""
    g = grad(fm.loss)

    def hvp(v):
        return jvp(lambda p: g(p, x, y), (flat,), (v,))[1]

    eye = torch.eye(fm.n, dtype=flat.dtype)
    h = vmap(hvp, chunk_size=chunk)(eye)
    return 0.5 * (h + h.T)
