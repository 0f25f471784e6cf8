"""The small models experiments train: three character-level causal language models; and the models
and parameter sets the step-time and memory benchmarks step on fixed gradients.

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

Benchmarks: ``MODELS`` (a 3.4 M-parameter ``nn.TransformerEncoder`` and a 2 M-parameter MLP, each
with its input batch; ``model_loss`` gives a loss to differentiate), ``small_tensor_stack`` (many
small tensors: host work per tensor), ``mlp_stack`` (square layers, sized by width and depth, for
memory budgets), ``gpt2_shapes`` with ``make_param_set`` (GPT-2-shaped parameter sets with structured
gradients, for GPU steps).

Models whose full Hessian fits on a CPU (experiments/hessian_alignment.py): ``TinyCharTransformer``
(one pre-norm block, separate q/k/v/o projections with biases, GELU MLP, learned token and position
tables, untied head; nanoGPT's and Llama's parameter names, so Adam-mini's name rules apply; its
attention written out so that forward-mode AD runs) and ``CharMLP`` (next character from the one-hot
codes of the previous ``context`` characters, two tanh layers).

Sparse embeddings (Disk Sparse Adam): ``EmbeddingSquare`` (one ``nn.Embedding(sparse=True)``, loss
the mean square of the looked-up rows: Disk Sparse Adam's seed configuration) and ``DistMult``, a
knowledge-graph scorer with an entity and a relation table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from experiments.harness.data import VOCAB_SIZE


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


def make_param_set(shapes, dtype, device, seed):
    """(params, grads) of the given shapes: params ~ 0.02 N(0, 1); grads ~ 1e-3 N(0, 1) with one
    random log-normal scale per matrix row (the structure Gefen's block rule finds)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ps, gs = [], []
    for sh in shapes:
        ps.append(torch.randn(sh, generator=gen, device=device).mul_(0.02).to(dtype))
        g = torch.randn(sh, generator=gen, device=device).mul_(1e-3)
        if len(sh) == 2:
            g.mul_(torch.randn(sh[0], 1, generator=gen, device=device).mul_(0.7).exp_())
        gs.append(g.to(dtype))
    return ps, gs


class Encoder(nn.Module):
    """Token embedding + ``nn.TransformerEncoder`` (tied output): 3.42 M parameters at the defaults."""

    def __init__(self, vocab=1000, d=256, layers=4, heads=8, ff=1024, ctx=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        # fixed sinusoidal positions: the model is the embedding and the encoder, 3,415,040 params
        pos = torch.arange(ctx, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
        self.register_buffer("pos", torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1))
        layer = nn.TransformerEncoderLayer(d, heads, ff, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx))

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        h = self.enc(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return h @ self.emb.weight.t()


def make_mlp(hidden=1024):
    """784 -> hidden -> hidden -> 10 with GELUs: 1.86 M parameters at the default width."""
    return nn.Sequential(nn.Linear(784, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 10))


def mlp_stack(width: int, depth: int) -> nn.Sequential:
    """``depth`` layers ``nn.Linear(width, width)`` with ReLUs between them: depth * (width² + width)
    parameters, so a memory budget's largest model is a search over one number."""
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def small_tensor_stack(tensors: int, width: int = 64):
    """``tensors`` / 4 blocks of ``nn.Linear(width, width)`` + ``nn.LayerNorm(width)`` (four tensors
    each: weight, bias, gain, bias); 160 tensors at width 64 are 171,520 parameters."""
    if tensors <= 0 or tensors % 4:
        raise ValueError(f"small_tensor_stack: {tensors} tensors is not a positive multiple of 4 (Linear + LayerNorm)")
    return nn.Sequential(*[m for _ in range(tensors // 4) for m in (nn.Linear(width, width), nn.LayerNorm(width))])


# the step-time and memory benchmarks' models: name -> (model, input batch, Adam-mini's (dim, n_heads))
MODELS = {
    "transformer": (lambda: Encoder(), lambda: torch.randint(0, 1000, (8, 64)), (256, 8)),
    "mlp": (make_mlp, lambda: torch.randn(64, 784), (256, 8)),
}


def model_loss(model, x):
    """A loss to differentiate: next-token cross-entropy for an ``Encoder``, else the mean square output."""
    out = model(x)
    if isinstance(model, Encoder):
        return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))
    return out.pow(2).mean()


# ---------------------------------------------------------------- models whose full Hessian fits
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


# ------------------------------------------------------------------------------ sparse embeddings
class EmbeddingSquare(nn.Module):
    """``nn.Embedding(rows, dim, sparse=True)``; ``loss(idx)`` is the mean square of the rows looked up."""

    def __init__(self, rows, dim):
        super().__init__()
        self.emb = nn.Embedding(rows, dim, sparse=True)

    def loss(self, idx):
        return (self.emb(idx) ** 2).mean()


class DistMult(nn.Module):
    """DistMult (Yang et al. 2015): score(h, r, t) = sum(e_h * w_r * e_t) over sparse entity and
    relation tables. ``loss(h, r, t, neg)``: logistic loss of the true tails against the negative
    tails ``neg`` (batch, k). ``init_std``: both tables drawn from N(0, init_std²) after construction
    (None: nn.Embedding's N(0, 1))."""

    def __init__(self, entities, relations, dim, init_std=None):
        super().__init__()
        self.ent = nn.Embedding(entities, dim, sparse=True)
        self.rel = nn.Embedding(relations, dim, sparse=True)
        if init_std is not None:
            with torch.no_grad():
                self.ent.weight.normal_(0, init_std)
                self.rel.weight.normal_(0, init_std)

    def loss(self, h, r, t, neg):
        eh, er = self.ent(h), self.rel(r)
        pos = (eh * er * self.ent(t)).sum(-1)
        negs = ((eh * er).unsqueeze(1) * self.ent(neg)).sum(-1)
        return F.softplus(-pos).mean() + F.softplus(negs).mean()
