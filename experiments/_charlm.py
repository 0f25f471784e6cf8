"""A character-level language model on text that ships with every Python: data and a small GPT.

Shared by the experiments that need a real (not synthetic) training problem on a CPU. Nothing is
downloaded: the corpus is Python's documentation topics (``pydoc_data.topics.topics``, about
0.46 M characters) followed by the standard library's top-level ``.py`` sources, in sorted order,
cut at ``max_chars``. The vocabulary is fixed (tab, newline, printable ASCII, one "other" token),
so token ids do not depend on the corpus. The train/validation split is by contiguous chunks
(every ``val_every``-th chunk of ``chunk_chars`` characters is validation), so both halves mix
documentation and code.

The model is nanoGPT's (Karpathy) pre-LayerNorm decoder, with attention projections named the way
Adam-mini's name rules expect (``wte``, ``attn.q_proj``/``k_proj``/``v_proj``/``o_proj``, ``mlp``,
``lm_head``), so that optimizer gets its intended blocks.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# tab, newline, printable ASCII; everything else maps to one extra token
VOCAB = "\t\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCAB) + 1
OTHER = len(VOCAB)


def stdlib_sources() -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted by name (a fixed list per Python version)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"{root}: no standard-library .py sources found; this Python ships none")
    return files


def load_text(max_chars: int) -> str:
    """Documentation topics (sorted by key), then stdlib sources (sorted by name), cut at ``max_chars``."""
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    from pydoc_data.topics import topics

    def documents():
        for key in sorted(topics):
            yield topics[key]
        for path in stdlib_sources():
            yield path.read_text(encoding="utf-8", errors="replace")

    parts, total = [], 0
    for doc in documents():
        take = doc[: max_chars - total]
        parts.append(take)
        total += len(take)
        if total >= max_chars:
            break
    return "".join(parts)


def encode(text: str) -> torch.Tensor:
    """Characters to token ids (int64) in the fixed vocabulary."""
    table = np.full(0x110000, OTHER, dtype=np.int64)
    table[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB))
    codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return torch.from_numpy(table[codepoints])


def decode(ids) -> str:
    return "".join(VOCAB[i] if i < len(VOCAB) else "\ufffd" for i in torch.as_tensor(ids).tolist())


def split(ids: torch.Tensor, chunk_chars: int = 4096, val_every: int = 10):
    """Contiguous chunks; every ``val_every``-th chunk (the last of each group) goes to validation."""
    chunks = torch.split(ids, chunk_chars)
    train = [c for i, c in enumerate(chunks) if i % val_every != val_every - 1]
    val = [c for i, c in enumerate(chunks) if i % val_every == val_every - 1]
    if not val:
        raise ValueError(f"corpus of {ids.numel()} chars is too short for a validation split "
                         f"({val_every} chunks of {chunk_chars} needed); raise max_chars")
    return torch.cat(train), torch.cat(val)


def load_splits(max_chars: int, chunk_chars: int = 4096, val_every: int = 10):
    return split(encode(load_text(max_chars)), chunk_chars, val_every)


def get_batch(data: torch.Tensor, batch: int, block: int, generator: torch.Generator):
    """Random windows of ``block + 1`` tokens: inputs and next-token targets."""
    starts = torch.randint(0, data.numel() - block - 1, (batch,), generator=generator)
    idx = starts[:, None] + torch.arange(block + 1)
    windows = data[idx]
    return windows[:, :-1], windows[:, 1:]


def eval_windows(data: torch.Tensor, n: int, block: int):
    """``n`` evenly spaced windows over ``data``: the same validation set for every run."""
    starts = torch.linspace(0, data.numel() - block - 2, n).long()
    windows = data[starts[:, None] + torch.arange(block + 1)]
    return windows[:, :-1], windows[:, 1:]


@dataclass
class GPTConfig:
    block: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    vocab: int = VOCAB_SIZE


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT-style decoder without weight tying (Adam-mini treats ``wte`` and ``lm_head`` apart)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        self.apply(self._init)
        # GPT-2's scaled init of the projections that write into the residual stream
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "mlp.proj.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        if t > self.cfg.block:
            raise ValueError(f"sequence length {t} exceeds the model's block size {self.cfg.block}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: GPT, x: torch.Tensor, y: torch.Tensor, batch: int = 64) -> float:
    """Mean next-character cross-entropy (nats) over fixed windows."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, x.shape[0], batch):
        total += float(model(x[i:i + batch], y[i:i + batch])) * x[i:i + batch].shape[0]
    model.train(was_training)
    return total / x.shape[0]
