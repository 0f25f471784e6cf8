"""The small models experiments train: nanoGPT's character-level decoder.

The GPT is nanoGPT's (Karpathy) pre-LayerNorm decoder without weight tying, with attention
projections named the way Adam-mini's name rules expect (``wte``, ``attn.q_proj``/``k_proj``/
``v_proj``/``o_proj``, ``mlp``, ``lm_head``), so that optimizer gets its intended blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from experiments.data import VOCAB_SIZE


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
        # the loss in fp32 whatever the weights' dtype (a bf16 model's logits too)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


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


# GPT-2 small (124 M parameters) and XL (1.56 B): (d_model, layers), for benchmarks and traffic models
GPT2_SIZES = {"125M": (768, 12), "1.5B": (1600, 48)}
GPT2_VOCAB, GPT2_CTX = 50257, 1024


def gpt2_shapes(d, layers, vocab=GPT2_VOCAB, ctx=GPT2_CTX):
    """Parameter shapes of a GPT-2 with tied embeddings (the layout of HF's GPT2LMHeadModel)."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
                   (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]
