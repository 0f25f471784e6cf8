"""Tiny models whose full Hessian fits on a CPU, their data, and the Hessian itself.

Used by ``experiments/hessian_alignment.py``. Everything works on one flat parameter vector, so the
Hessian is an ordinary ``n x n`` matrix and every block scheme is a vector of block ids.

- Data: Python's documentation topics (experiments/data.py), characters mapped to the ``vocab - 1`` most frequent ones plus one "other" symbol; the first 90 % is
  the training split, the rest the validation split.
- ``TinyCharTransformer``: one pre-norm transformer block (separate q/k/v/o projections, GELU MLP),
  learned token and position tables, an untied output head. Parameter names follow nanoGPT
  (``wte``, ``wpe``, ``lm_head``) and Llama (``q_proj`` ...) so that Adam-mini's name rules apply.
- ``CharMLP``: next character from the one-hot codes of the previous ``context`` characters, two
  hidden tanh layers.
- ``hessian``: forward-over-reverse Hessian-vector products (``torch.func.jvp`` of ``torch.func.grad``)
  against the identity, vmapped in chunks, float64.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp, vmap

from experiments import data


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
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        if d % n_heads:
            raise ValueError(f"d_model={d} must be a multiple of n_heads={n_heads}")
        self.n_heads = n_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.o_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.n_heads

        def split(z):
            return z.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        # Written out (not scaled_dot_product_attention) so forward-mode AD works everywhere.
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.o_proj(y)


class FeedForward(nn.Module):
    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TinyCharTransformer(nn.Module):
    """One pre-norm transformer block over characters (a few thousand parameters)."""

    kind = "transformer"

    def __init__(self, vocab: int, ctx: int, d: int, n_heads: int, d_ff: int):
        super().__init__()
        self.vocab, self.ctx, self.d, self.n_heads = vocab, ctx, d, n_heads
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        nn.init.normal_(self.wte.weight, std=0.5)
        nn.init.normal_(self.wpe.weight, std=0.1)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_heads)
        self.mlp = FeedForward(d, d_ff)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        h = h + self.attn(self.ln1(h))
        h = h + self.mlp(self.ln2(h))
        return self.lm_head(self.ln_f(h))


class CharMLP(nn.Module):
    """Next character from the one-hot codes of the previous ``context`` characters."""

    kind = "mlp"

    def __init__(self, vocab: int, context: int, hidden: int):
        super().__init__()
        self.vocab, self.context = vocab, context
        self.mlp = nn.Sequential(
            nn.Linear(context * vocab, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()
        )
        self.lm_head = nn.Linear(hidden, vocab)

    def forward(self, x):
        # x: [batch, length] of ids; predicts position t+1 from positions t-context+1 .. t, so the
        # first context-1 positions are dropped by ``loss_fn``.
        # a comparison, not F.one_hot: one_hot checks its input's range, which vmap cannot trace
        onehot = (x[..., None] == torch.arange(self.vocab, device=x.device)).to(self.lm_head.weight.dtype)
        win = onehot.unfold(1, self.context, 1)  # [b, t-c+1, vocab, c]
        win = win.transpose(-1, -2).reshape(x.shape[0], -1, self.context * self.vocab)
        return self.lm_head(self.mlp(win))


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
