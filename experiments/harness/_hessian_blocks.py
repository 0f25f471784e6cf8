"""Block schemes for a shared second moment, their within-block statistics, and an unquantised
Adam whose second moment is shared inside blocks. Used by ``experiments/hessian_alignment.py``.

A block scheme is a vector of block ids, one per entry of the flat parameter vector; blocks never
cross tensors. Schemes:

- ``per_element``: every entry its own block (Adam / AdamW).
- ``gefen`` / ``gefen_var``: Gefen's automatic block length per tensor from its first gradient,
  ``optim.gefen.partition.choose_block(grad, rule)`` with rule ``"adjacent_log"`` (upstream's
  current rule) or ``"variance_drop"`` (the paper-era rule); consecutive runs of P flat entries.
- ``random_gefen`` / ``random_gefen_var``: the same block sizes per tensor, members drawn at random
  inside the tensor.
- ``adam_mini``: Adam-mini's name rules, re-stated from the ``adam-mini`` package (``adam_mini.py``,
  ``Adam_mini.step``) and checked in this order on the lower-cased parameter name: "bias" -> one block
  per entry; q/k names (``q_proj k_proj wq wk query key``) -> one block per head, ``d*d/n_heads``
  consecutive entries; embedding / output / v / attention-projection / MLP names (``embed embd wte``,
  ``lm_head output final_layer``, ``v_proj wv value``, ``o_proj wo attn.proj``,
  ``feed_forward linear mlp``) -> one block per row (per token or output neuron); anything else
  (norms, nanoGPT's ``wpe``) -> the whole tensor.
- ``per_tensor``: one block per tensor.
- ``gefen_factored``: Gefen's blocks, kept inside matrix rows as the optimizer keeps them
  (``partition.factored_block``), with the factored second moment of
  ``Gefen(layout="factored")``: v of entry j of block b is ``v_b * w_j / mean(w)``, w the
  per-tensor EMA of the mean over blocks of g**2 at offset j (:func:`factor_ids`,
  ``SharedVAdam(factors=...)``; ``optim/gefen/reference.py`` states the estimator).
"""

from __future__ import annotations

import math

import torch

ADAM_MINI_EMBD = ("embed", "embd", "wte")
ADAM_MINI_OUTPUT = ("lm_head", "output", "final_layer")
ADAM_MINI_QK = ("k_proj", "q_proj", "wq", "wk", "query", "key")
ADAM_MINI_V = ("v_proj", "wv", "value")
ADAM_MINI_PROJ = ("o_proj", "wo", "attn.proj")
ADAM_MINI_MLP = ("feed_forward", "linear", "mlp")


def _ids_from_lengths(slices, lengths) -> torch.Tensor:
    """Consecutive blocks of ``lengths[t]`` flat entries inside each tensor t."""
    parts, nxt = [], 0
    for (_, _, sl), p in zip(slices, lengths):
        n = sl.stop - sl.start
        parts.append(nxt + torch.arange(n) // p)
        nxt += n // p
    return torch.cat(parts)


def gefen_lengths(slices, first_grad: torch.Tensor, rule: str, *, factored: bool = False) -> list[int]:
    """Gefen's block length per tensor from the first gradient (flat vector); ``factored``: as the
    factored second moment keeps them (inside matrix rows)."""
    from optim.gefen.partition import choose_block, factored_block

    out = []
    for _, shape, sl in slices:
        p = int(choose_block(first_grad[sl].view(shape), rule=rule))
        out.append(factored_block(p, shape) if factored else p)
    return out


def scheme_ids(scheme: str, slices, *, first_grad=None, n_heads=1, d_model=1, seed=0) -> torch.Tensor:
    """Block id per flat entry for one scheme (see the module docstring)."""
    if scheme == "per_element":
        return torch.arange(slices[-1][2].stop)
    if scheme == "per_tensor":
        return _ids_from_lengths(slices, [sl.stop - sl.start for _, _, sl in slices])
    if scheme in ("gefen", "gefen_var", "random_gefen", "random_gefen_var", "gefen_factored"):
        if first_grad is None:
            raise ValueError(f"scheme {scheme!r} needs first_grad (the first gradient, flat)")
        rule = "variance_drop" if scheme.endswith("_var") else "adjacent_log"
        ids = _ids_from_lengths(slices, gefen_lengths(slices, first_grad, rule, factored=scheme in FACTORED))
        if scheme.startswith("random_"):
            gen = torch.Generator().manual_seed(seed)
            for _, _, sl in slices:  # shuffle memberships inside each tensor, sizes kept
                seg = ids[sl]
                ids[sl] = seg[torch.randperm(seg.numel(), generator=gen)]
        return ids
    if scheme == "adam_mini":
        return adam_mini_ids(slices, n_heads=n_heads, d_model=d_model)
    raise ValueError(f"unknown block scheme {scheme!r}; choose one of {SCHEMES}")


SCHEMES = ("per_element", "gefen", "gefen_var", "random_gefen", "random_gefen_var", "adam_mini", "per_tensor")
FACTORED = ("gefen_factored",)  # schemes with a per-offset factor; blocks: "gefen"'s inside rows


def factor_ids(scheme: str, slices, *, first_grad=None):
    """(factor id per flat entry, tensor of each factor id) for ``SharedVAdam(factors=...)``.

    ``gefen_factored``: one factor per (tensor, offset in Gefen's block). Any other scheme: one
    factor per tensor, whose ratio w / mean(w) is exactly 1 (the scheme's own rule unchanged).
    """
    lengths = (gefen_lengths(slices, first_grad, "adjacent_log", factored=True) if scheme in FACTORED
               else [sl.stop - sl.start for _, _, sl in slices])
    fids, tens, nxt = [], [], 0
    for t, ((_, _, sl), p) in enumerate(zip(slices, lengths)):
        n = sl.stop - sl.start
        width = p if scheme in FACTORED else 1
        fids.append(nxt + torch.arange(n) % width)
        tens.append(torch.full((width,), t))
        nxt += width
    return torch.cat(fids), torch.cat(tens)


def adam_mini_ids(slices, *, n_heads: int, d_model: int) -> torch.Tensor:
    """Adam-mini's name-based blocks (rule order as in ``adam_mini.Adam_mini.step``)."""
    lengths = []
    head_numel = d_model * d_model // n_heads
    for name, shape, sl in slices:
        name, n = name.lower(), sl.stop - sl.start
        if "bias" in name:
            lengths.append(1)
        elif any(k in name for k in ADAM_MINI_QK):
            if n % head_numel:
                raise ValueError(f"{name}: {n} entries are not whole heads of {head_numel}")
            lengths.append(head_numel)
        elif any(k in name for k in ADAM_MINI_EMBD + ADAM_MINI_OUTPUT + ADAM_MINI_V + ADAM_MINI_PROJ + ADAM_MINI_MLP):
            lengths.append(n // shape[0])  # one block per row: [rows, ...] viewed as a matrix
        else:
            lengths.append(n)
    return _ids_from_lengths(slices, lengths)


# --------------------------------------------------------------------------- block statistics
def block_stats(ids: torch.Tensor, coupling: torch.Tensor, spread: torch.Tensor, v: torch.Tensor,
                active: torch.Tensor) -> dict:
    """Within-block statistics of one scheme at one checkpoint.

    coupling, spread: [n, n] pair matrices (NaN where undefined); v: [n] mean over minibatches of
    g**2; active: [n] bool, entries whose statistics are defined. Per active entry, the mean over
    its active blockmates of coupling and of spread is taken, then averaged over entries (so a
    block weighs by its size). ``dispersion`` is the RMS over active entries of
    log(v_i / mean of v over i's block): how far the shared second moment is from each entry's own.
    """
    ids = ids.long()
    nb = int(ids.max()) + 1
    size = torch.bincount(ids, minlength=nb)
    vb = torch.bincount(ids, weights=v.double(), minlength=nb) / size
    disp = torch.log(v.double()[active] / vb[ids[active]])
    out = {
        "dispersion": float(disp.pow(2).mean().sqrt()),
        "frac_shared": float((size[ids] > 1).double().mean()),
        "n_blocks": nb,
        "mean_block": float(size[ids].double().mean()),
    }
    same = (ids[:, None] == ids[None, :]) & active[:, None] & active[None, :]
    same.fill_diagonal_(False)
    cnt = same.sum(1)
    has = cnt > 0
    if has.any():
        c = torch.where(same, coupling, 0.0).nan_to_num(0.0).sum(1)[has] / cnt[has]
        s = torch.where(same, spread, 0.0).nan_to_num(0.0).sum(1)[has] / cnt[has]
        out["coupling_within"] = float(c.mean())
        out["spread_within"] = float(s.mean())
    else:
        out["coupling_within"] = math.nan
        out["spread_within"] = math.nan
    return out


# ---------------------------------------------------------------------- shared second moment
class SharedVAdam:
    """AdamW on a flat vector with the second moment shared inside blocks, no quantisation.

    m <- b1*m + (1-b1)*g;  v_b <- b2*v_b + (1-b2)*mean_{i in b} g_i**2;  p <- p*(1 - lr*wd);
    p <- p - lr * (m/(1-b1**t)) / (sqrt(v_{b(i)}/(1-b2**t)) + eps).  With one block per entry this is
    ``torch.optim.AdamW``. ``factors=(fids, ftensor)`` (:func:`factor_ids`) scales v_b per entry by
    r = w_f / mean of w over f's tensor, w_f <- b2*w_f + (1-b2)*mean_{i in f} g_i**2.
    """

    def __init__(self, ids: torch.Tensor, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 factors=None):
        self.factors = None
        if factors is not None:
            fids, ftensor = factors[0].long(), factors[1].long()
            self.factors = (fids, ftensor, torch.bincount(fids).float(), torch.bincount(ftensor).float())
            self.w = torch.zeros(ftensor.numel())
        self.ids = ids.long()
        self.nb = int(self.ids.max()) + 1
        self.size = torch.bincount(self.ids, minlength=self.nb).float()
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.m = None
        self.v = torch.zeros(self.nb)
        self.t = 0

    @torch.no_grad()
    def step(self, p: torch.Tensor, g: torch.Tensor) -> None:
        b1, b2 = self.betas
        if self.m is None:
            self.m = torch.zeros_like(p)
        self.t += 1
        self.m.mul_(b1).add_(g, alpha=1 - b1)
        gb = torch.zeros(self.nb, dtype=g.dtype).index_add_(0, self.ids, g * g) / self.size
        self.v.mul_(b2).add_(gb, alpha=1 - b2)
        p.mul_(1 - self.lr * self.wd)
        v = self.v[self.ids]
        if self.factors is not None:
            fids, ftensor, fsize, tsize = self.factors
            self.w.mul_(b2).add_(torch.zeros_like(self.w).index_add_(0, fids, g * g) / fsize, alpha=1 - b2)
            mean = (torch.zeros_like(tsize).index_add_(0, ftensor, self.w) / tsize)[ftensor]
            r = torch.where(mean > 0, self.w / mean.clamp_min(1e-38), torch.ones_like(mean))
            v = v * r[fids]
        denom = (v / (1 - b2 ** self.t)).sqrt_().add_(self.eps)
        p.addcdiv_(self.m, denom, value=-self.lr / (1 - b1 ** self.t))
