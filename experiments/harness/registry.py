"""The optimizer registry: one name per optimizer, used as the variant name in every CSV and figure.

    opt = make_optimizer("Gefen-8bit", model, lr=3e-3, weight_decay=0.1)
    opt = make_optimizer("DiskSparseAdam", [emb.weight], lr=1e-3, state_dir=tmp)

``model_or_params`` is an ``nn.Module`` or what ``torch.optim`` accepts (tensors or param-group
dicts); optimizers that need parameter names (Adam-mini) need a module. Keyword options go to the
constructor. Dense peers: AdamW (torch, fused), Adam-mini, torchao's AdamW8bit / AdamW4bit,
upstream ``gefen``, its maintained fork ``gefen-x`` (installed beside it, see ``gefen_x``), ours at 8
and 4 bits (and with the factored second moment); on a GPU also FlashOptim's FlashAdamW and
bitsandbytes' AdamW8bit (``GPU_PEERS``); on the CPU also DeepSpeed's CPU-Adam and bitsandbytes'
AdamW8bit (``CPU_PEERS``). Sparse: torch's SparseAdam, ours on disk (Euclidean and
Poincaré ball), geoopt's SparseRiemannianAdam (its parameter must be a ``geoopt.ManifoldParameter``).

State bytes (``state_bytes``) are the tensor bytes of ``optimizer.state_dict()``, tensor subclasses
(torchao's quantised states) counted by their inner tensors, non-tensor entries not counted.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import re
import sys
from pathlib import Path

import torch


def _adamw(params, named, lr, weight_decay, **kw):
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True, **kw)


def _adam_mini(params, named, lr, weight_decay, *, dim, n_heads, **kw):
    from adam_mini import Adam_mini

    if named is None:
        raise TypeError("Adam-mini needs parameter names: pass the nn.Module")
    opt = Adam_mini(named, lr=lr, weight_decay=weight_decay, dim=dim, n_heads=n_heads, verbose=False, **kw)
    opt.embd_names.add("wpe")  # a learned position table: one second moment per position, like wte
    return opt


def _torchao(cls_name):
    def make(params, named, lr, weight_decay, **kw):
        import torchao.optim

        return getattr(torchao.optim, cls_name)(params, lr=lr, weight_decay=weight_decay, **kw)
    return make


def _gefen_upstream(params, named, lr, weight_decay, **kw):
    import gefen

    fused = kw.pop("fused", any(p.is_cuda for p in _tensors(params)))  # its fused path is CUDA only
    return gefen.Gefen(named if named is not None else params, lr=lr, weight_decay=weight_decay, fused=fused, **kw)


GEFEN_X_DIR = Path(__file__).resolve().parents[2] / "third_party" / "gefen_x"
GEFEN_X_INSTALL = "python -m pip install --no-deps --upgrade --target third_party/gefen_x gefen-x==0.5.0"


class _Renamed(importlib.abc.MetaPathFinder):
    """Imports the package ``source`` found in ``folder`` as ``alias`` (and ``alias.x`` for its
    ``source.x``), rewriting its absolute imports of ``source`` to ``alias`` as it loads each module,
    so that a package installed beside another of the same name (gefen-x installs as ``gefen``, as
    upstream does) runs without touching ``sys.modules["gefen"]``."""

    def __init__(self, alias, source, folder):
        self.alias, self.source, self.root = alias, source, Path(folder) / source
        self._imports = re.compile(rf"^(\s*(?:from|import)\s+){source}(?=[\s.])", re.M)

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.alias and not fullname.startswith(self.alias + "."):
            return None
        base = self.root.joinpath(*fullname.split(".")[1:])
        if (base / "__init__.py").is_file():
            origin, where = base / "__init__.py", [str(base)]
        elif base.with_suffix(".py").is_file():
            origin, where = base.with_suffix(".py"), None
        else:
            return None
        loader = _RewritingLoader(fullname, str(origin), self)
        return importlib.util.spec_from_file_location(fullname, origin, loader=loader,
                                                      submodule_search_locations=where)


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname, path, finder):
        super().__init__(fullname, path)
        self.finder = finder

    def get_code(self, fullname):  # never the bytecode cache: it would hold the rewritten imports
        source = Path(self.path).read_text()
        return compile(self.finder._imports.sub(rf"\g<1>{self.finder.alias}", source), self.path, "exec",
                       dont_inherit=True)


def gefen_x():
    """The gefen-x package (the maintained fork of upstream gefen) as module ``gefen_x``, from
    ``third_party/gefen_x`` (installed there by ``GEFEN_X_INSTALL``); None where it is not."""
    if not (GEFEN_X_DIR / "gefen" / "__init__.py").is_file():
        return None
    if not any(isinstance(f, _Renamed) and f.alias == "gefen_x" for f in sys.meta_path):
        sys.meta_path.insert(0, _Renamed("gefen_x", "gefen", GEFEN_X_DIR))
    return importlib.import_module("gefen_x")


def gefen_x_version() -> str:
    """gefen-x's version from its install folder's metadata ("" where it is not installed)."""
    found = sorted(GEFEN_X_DIR.glob("gefen_x-*.dist-info"))
    return found[-1].name.removeprefix("gefen_x-").removesuffix(".dist-info") if found else ""


def _gefen_x(params, named, lr, weight_decay, **kw):
    mod = gefen_x()
    if mod is None:
        raise ModuleNotFoundError(f"gefen-x is not installed in {GEFEN_X_DIR}; install it with: {GEFEN_X_INSTALL}")
    fused = kw.pop("fused", any(p.is_cuda for p in _tensors(params)))  # its fused path is CUDA only
    return mod.Gefen(named if named is not None else params, lr=lr, weight_decay=weight_decay, fused=fused, **kw)


def _flashoptim_adamw(params, named, lr, weight_decay, **kw):
    import flashoptim

    # 24-bit master weights (its default) apply to bf16 parameters; fp32 ones keep their own bits
    if all(p.dtype == torch.float32 for p in _tensors(params)):
        kw.setdefault("master_weight_bits", None)
    return flashoptim.FlashAdamW(params, lr=lr, weight_decay=weight_decay, **kw)


def _bnb_adamw8bit(params, named, lr, weight_decay, **kw):
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay, **kw)


def _deepspeed_cpu_adam(params, named, lr, weight_decay, **kw):
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # builds its C++ op on first use (ninja, a compiler)

    class CheckedCPUAdam(DeepSpeedCPUAdam):
        """DeepSpeed's CPU-Adam, refusing a gradient whose dtype is not its parameter's: its C++ step
        reads the gradient as the parameter's dtype, so bf16 gradients of fp32 weights are read past
        their end (garbage, or a segfault once the tensors are large)."""

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and p.grad.dtype != p.dtype:
                        raise TypeError(f"deepspeed-CPUAdam: a {p.grad.dtype} gradient of a {p.dtype} parameter; "
                                        "its step reads the gradient as the parameter's dtype: cast it first")
            return super().step(closure)

    return CheckedCPUAdam(params, lr=lr, weight_decay=weight_decay, adamw_mode=True, **kw)


def _gefen(bits, layout):
    """Gefen at ``bits`` with the named ``layout`` (``optim.gefen.layout.LAYOUTS``); ``layout=`` among the
    options gives another (a record, for an ablation)."""
    def make(params, named, lr, weight_decay, **kw):
        from optim import Gefen

        kw.setdefault("layout", layout)
        return Gefen(params, lr=lr, weight_decay=weight_decay, bits=bits, **kw)
    return make


def _sparse_adam(params, named, lr, weight_decay, **kw):
    return torch.optim.SparseAdam(params, lr=lr, **kw)


def _dsa(params, named, lr, weight_decay, **kw):
    from optim import DiskSparseAdam

    return DiskSparseAdam(params, lr=lr, **kw)


def _dsa_riemannian(params, named, lr, weight_decay, **kw):
    from optim import DiskSparseRiemannianAdam

    return DiskSparseRiemannianAdam(params, lr=lr, **kw)


def _geoopt(params, named, lr, weight_decay, **kw):
    import geoopt

    return geoopt.optim.SparseRiemannianAdam(params, lr=lr, **kw)


OPTIMIZERS = {
    "AdamW": _adamw,
    "Adam-mini": _adam_mini,
    "torchao-AdamW8bit": _torchao("AdamW8bit"),
    "torchao-AdamW4bit": _torchao("AdamW4bit"),
    "gefen-upstream": _gefen_upstream,
    "gefen-x": _gefen_x,
    "flashoptim-AdamW": _flashoptim_adamw,
    "bnb-AdamW8bit": _bnb_adamw8bit,
    "deepspeed-CPUAdam": _deepspeed_cpu_adam,
    "Gefen-8bit": _gefen(8, "published"),
    "Gefen-4bit": _gefen(4, "published"),
    "Gefen-8bit-factored": _gefen(8, "factored"),
    "Gefen-4bit-factored": _gefen(4, "factored"),
    "Gefen-8bit-compact": _gefen(8, "compact"),
    "Gefen-4bit-compact": _gefen(4, "compact"),
    "SparseAdam": _sparse_adam,
    "DiskSparseAdam": _dsa,
    "DiskSparseRiemannianAdam": _dsa_riemannian,
    "geoopt-SparseRiemannianAdam": _geoopt,
}
DENSE = ["AdamW", "Adam-mini", "torchao-AdamW8bit", "torchao-AdamW4bit", "gefen-upstream", "gefen-x", "Gefen-8bit",
         "Gefen-4bit", "Gefen-8bit-factored", "Gefen-4bit-factored", "Gefen-8bit-compact", "Gefen-4bit-compact"]
# 8-bit peers with CUDA-only kernels, timed by experiments/bench_kernels.py on a GPU (not in
# requirements.txt: carried to a GPU machine as wheels, see experiments/gpu_checks.sh)
GPU_PEERS = ["flashoptim-AdamW", "bnb-AdamW8bit", "torchao-AdamW8bit", "gefen-x"]
# peers with CPU kernels, timed beside ours by experiments/gefen_speed.py: DeepSpeed's CPU-Adam (the
# AdamW step of ZeRO-Offload) and bitsandbytes' 8-bit AdamW. Not in requirements.txt: DeepSpeed's
# source distribution imports torch to build, so it installs without pip's build isolation, and
# compiles its op on first use.
CPU_PEERS = ["deepspeed-CPUAdam", "bnb-AdamW8bit"]
CPU_PEERS_INSTALL = "python -m pip install --no-build-isolation deepspeed==0.19.8 bitsandbytes==0.50.2"


def _tensors(params):
    for p in params:
        if isinstance(p, dict):
            yield from p["params"]
        else:
            yield p


def make_optimizer(name, model_or_params, lr, weight_decay=0.0, **options):
    """The optimizer registered as ``name`` over a module's parameters (or the given parameters)."""
    if name not in OPTIMIZERS:
        raise KeyError(f"unknown optimizer {name!r}; registered: {', '.join(OPTIMIZERS)}")
    if isinstance(model_or_params, torch.nn.Module):
        named = list(model_or_params.named_parameters())
        params = [p for _, p in named]
    else:
        named, params = None, list(model_or_params)
    # upstream gefen prints while it sets up; keep the logs readable
    with contextlib.redirect_stdout(io.StringIO()):
        return OPTIMIZERS[name](params, named, lr, weight_decay, **options)


def tensor_bytes(obj, _seen=None) -> int:
    """Bytes of every tensor inside ``obj`` (nested dicts/lists/tuples), each storage view once.

    Tensor subclasses (torchao's quantised states) count by their inner tensors (codes, scales,
    code maps), not by the dense shape they present. Non-tensor entries count nothing.
    """
    seen = set() if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n), seen) for n in names)
        nbytes = obj.numel() * obj.element_size()
        key = (obj.data_ptr(), nbytes, obj.dtype)
        if nbytes and key in seen:
            return 0
        seen.add(key)
        return nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def state_bytes(opt) -> int:
    """Tensor bytes of the optimizer's state dict (see ``tensor_bytes``)."""
    return tensor_bytes(opt.state_dict())


def dsa_state_bytes_per_row(dim: int, state_format: str) -> int:
    """Bytes of one table row's Disk Sparse Adam state record on disk: two float32 moments in the
    "exact" format, the compact format's 8-bit first moment with its scale and row-wise v otherwise."""
    if state_format == "exact":
        return 2 * 4 * dim
    from optim.disk_sparse import compact

    return compact.record_bytes(dim)


KINDS = ("matrix", "embedding", "vector", "shared")


def tensor_kind(name: str, p: torch.Tensor, embedding_weights: set) -> str:
    """A parameter's kind: "vector" (one dimension or none: biases, norm gains), "embedding" (an
    ``nn.Embedding`` weight, or a table registered on the model itself, without a dotted name: a
    learned position table), "matrix" (every other tensor: projections and heads)."""
    if p.dim() < 2:
        return "vector"
    return "embedding" if id(p) in embedding_weights or "." not in name else "matrix"


def state_bytes_by_kind(opt, model: torch.nn.Module) -> dict:
    """``{kind: (state bytes, parameters)}`` over ``KINDS``: each parameter's state-dict entry
    (``tensor_bytes``, each storage once) under its ``tensor_kind``, and under "shared" every byte
    that no one parameter's entry holds (codebooks, global steps; parameters 0). The bytes add up
    to ``state_bytes(opt)``."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    kind_of, out = {}, {k: [0, 0] for k in KINDS}
    for n, p in model.named_parameters():
        kind_of[id(p)] = tensor_kind(n, p, embedding_weights)
        out[kind_of[id(p)]][1] += p.numel()
    rest = opt.state_dict()
    state = rest.pop("state", {})
    # state_dict numbers the parameters in param_groups order
    params = [p for g in opt.param_groups for p in g["params"]]
    seen, unowned = set(), []
    for i, entry in state.items():
        p = params[i] if isinstance(i, int) and i < len(params) else None
        if p is not None and id(p) in kind_of:
            out[kind_of[id(p)]][0] += tensor_bytes(entry, seen)
        else:
            unowned.append(entry)
    out["shared"][0] += tensor_bytes([unowned, rest], seen)
    return {k: tuple(v) for k, v in out.items()}
