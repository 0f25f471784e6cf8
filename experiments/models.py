"""The small models experiments train: three character-level causal language models.

The GPT is nanoGPT's (Karpathy) pre-LayerNorm decoder without weight tying, with attention
projections named the way Adam-mini's name rules expect (``wte``, ``attn.q_proj``/``k_proj``/
``v_proj``/``o_proj``, ``mlp``, ``lm_head``), so that optimizer gets its intended blocks.

Two other architectures, for judging optimizers on models they were not developed on:
``EncoderLM``, a stack of PyTorch's own pre-norm ``nn.TransformerEncoderLayer`` under a causal mask
(the fused ``in_proj_weight`` holds q, k and v in one tensor; biases everywhere; PyTorch's default
initialisation, positional embeddings at zero), and ``LlamaLM``, a Llama-style decoder (RMSNorm,
SwiGLU MLP, rotary position embeddings, no biases; parameters named as Hugging Face's Llama names
them). Every model maps token ids ``idx`` (batch, time) to logits, or with ``targets`` to the mean
cross-entropy computed in fp32; ``char_lm_model(cfg)`` builds the model of a config.
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


def _lm_loss(logits, targets):
    """Mean next-token cross-entropy in fp32 whatever the weights' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _check_length(t, block):
    if t > block:
        raise ValueError(f"sequence length {t} exceeds the model's block size {block}")


@dataclass
class EncoderLMConfig(GPTConfig):
    n_embd: int = 128
    ff_mult: int = 4  # feed-forward width / n_embd


class EncoderLM(nn.Module):
    """``nn.TransformerEncoderLayer`` (``norm_first=True``, batch first, dropout 0, ReLU, the
    defaults otherwise) stacked under a causal mask: token plus learned positional embeddings (the
    latter initialised at zero), the layers, a final LayerNorm and an untied head without bias.
    Initialisation is PyTorch's default for every module but the positional table."""

    def __init__(self, cfg: EncoderLMConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.pos = nn.Parameter(torch.zeros(cfg.block, cfg.n_embd))
        # independent layers (nn.TransformerEncoder would deep-copy one, every layer starting alike)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(cfg.n_embd, cfg.n_head, dim_feedforward=cfg.ff_mult * cfg.n_embd, dropout=0.0,
                                       batch_first=True, norm_first=True) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        _check_length(t, self.cfg.block)
        x = self.tok(idx) + self.pos[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(x))
        return logits if targets is None else _lm_loss(logits, targets)


@dataclass
class LlamaConfig(GPTConfig):
    n_embd: int = 128
    ff_hidden: int = 0  # SwiGLU width; 0: Llama's 8/3 x n_embd rounded up to a multiple of 32
    rope_base: float = 10000.0
    norm_eps: float = 1e-5


def rotary(x, base):
    """Rotary position embedding of ``x`` (batch, heads, time, head_dim): the first and second halves
    of each head's features rotated pairwise by position t times base^(-2i/head_dim) (Llama's
    rotate-half layout)."""
    t, d = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.n_head, self.base = cfg.n_head, cfg.rope_base
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
                                                              for _ in range(4))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(rotary(q, self.base), rotary(k, self.base), v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hidden = cfg.ff_hidden or 32 * math.ceil(8 * cfg.n_embd / 3 / 32)
        self.gate_proj = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLM(nn.Module):
    """A Llama-style decoder: token embeddings, pre-RMSNorm blocks of rotary attention and a SwiGLU
    MLP, a final RMSNorm and an untied head; no biases. Linear and embedding weights are drawn from
    N(0, 0.02^2) (Hugging Face's Llama initialisation), norm gains at one."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets=None):
        _check_length(idx.shape[1], self.cfg.block)
        x = self.embed_tokens(idx)
        for blk in self.layers:
            x = blk(x)
        logits = self.lm_head(self.norm(x))
        return logits if targets is None else _lm_loss(logits, targets)


# architecture name (``CHAR_LM``'s "arch") -> (config class, model class)
ARCHITECTURES = {"gpt": (GPTConfig, GPT), "encoder": (EncoderLMConfig, EncoderLM), "llama": (LlamaConfig, LlamaLM)}


def char_lm_model(cfg) -> nn.Module:
    """The model of a config of ``ARCHITECTURES`` (a fresh initialisation from torch's generator)."""
    for config_cls, model_cls in ARCHITECTURES.values():
        if type(cfg) is config_cls:
            return model_cls(cfg)
    raise TypeError(f"no model for config {cfg!r}")


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 64) -> float:
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
