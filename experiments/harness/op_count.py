"""Count what an optimizer step asks of a device: torch operations outside kernel launches, and launches.

    with OpCount() as c:
        opt.step()
    c.device_ops, c.launches, c.host_syncs, c.ops.most_common(5)

    # the Triton path on CPU tensors, in a child process (Triton reads TRITON_INTERPRET at import):
    TRITON_INTERPRET=1 python -m experiments.harness.op_count --tensors 40 160 --optimizers Gefen-8bit Gefen-8bit-factored

A step's host cost on a GPU is set by how many things it enqueues: each torch operation on device
tensors is a kernel launch (or a host synchronisation) of several microseconds, and so is each Triton
launch. ``OpCount`` sees every aten operation through a ``TorchDispatchMode`` and every Triton launch by
wrapping the launch entry points (``JITFunction.run``, the interpreter's ``InterpretedFunction.run``, a
compiled kernel's ``[grid]``); counting pauses inside a launch, since under the interpreter the launch
itself runs torch operations on the kernel's arguments. Of the aten operations, ``device_ops`` leaves
out those that launch nothing on a GPU: views and aliases (``OpOverload.is_view``), the profiler's
record markers and allocations without a fill (``empty*``); ``aten_ops`` counts them all.
``host_syncs`` counts the operations that wait for the device: a value read on the host
(``.item()``, ``bool()``), shapes that depend on data (``nonzero``, ``masked_select``, ``unique``) and
copies from a GPU to the CPU.

The command line steps ``models.small_tensor_stack(n)`` (Linear(64, 64) + LayerNorm(64) blocks) with
each registry optimizer (Gefen variants with ``backend="triton"``) on fixed gradients and prints one
JSON line per (optimizer, tensors): the counts of each step after the first (which sets blocks and
learns the codebook). ``count_in_child`` runs it with TRITON_INTERPRET=1 and returns the records.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parent / "install_check.py"))

import argparse
import collections
import contextlib
import importlib.util
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from experiments.harness.child import child_env, emit_result, module_cmd, run_child
from experiments.harness.common import REPO_ROOT

# operations that wait for the device: a value read on the host, or an output shape that depends on data
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2", "unique_dim",
            "unique_consecutive", "repeat_interleave"}
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _launches_nothing(func) -> bool:
    """Views, aliases, profiler markers and bare allocations: no kernel on a GPU."""
    return func.is_view or func.namespace == "profiler" or func.overloadpacket.__name__ in ALLOCATIONS


def _reads_back(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return True
    if name in ("_to_copy", "copy_") and args and torch.is_tensor(args[0]):
        src, dst = (args[1], args[0]) if name == "copy_" else (args[0], None)
        dst_dev = dst.device if dst is not None else kwargs.get("device")
        return torch.is_tensor(src) and src.device.type != "cpu" and dst_dev is not None and torch.device(dst_dev).type == "cpu"
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        if not c._in_launch:
            name = f"{func.namespace}::{func.overloadpacket.__name__}"
            c.ops[name] += 1
            if not _launches_nothing(func):
                c.device_ops += 1
            if _reads_back(func, args, kwargs):
                c.host_syncs += 1
        return func(*args, **kwargs)


def _launch_entry_points():
    """[(class, attribute)] through which Triton launches a kernel, in the installed Triton."""
    if importlib.util.find_spec("triton") is None:
        return []
    import triton.runtime.jit as jit

    out = [(jit.JITFunction, "run")]
    with contextlib.suppress(ImportError, AttributeError):
        from triton.runtime.interpreter import InterpretedFunction

        out.append((InterpretedFunction, "run"))
    with contextlib.suppress(ImportError, AttributeError):
        from triton.compiler.compiler import CompiledKernel

        out.append((CompiledKernel, "__getitem__"))
    return out


class OpCount:
    """A context that counts the aten operations issued outside Triton launches (``ops``: name ->
    count; ``aten_ops``, ``device_ops``, ``host_syncs``) and the launches (``launches``; ``kernels``:
    kernel name -> launches). Not re-entrant; one context per counted region."""

    def __init__(self):
        self.ops = collections.Counter()
        self.kernels = collections.Counter()
        self.device_ops = self.launches = self.host_syncs = 0
        self._in_launch = 0
        self._patched = []
        self._mode = None

    @property
    def aten_ops(self) -> int:
        return sum(self.ops.values())

    def summary(self) -> dict:
        return dict(aten_ops=self.aten_ops, device_ops=self.device_ops, launches=self.launches,
                    host_syncs=self.host_syncs, top_ops=self.ops.most_common(6),
                    kernels=sorted(self.kernels.items()))

    def _launch(self, name):
        """Count one launch of ``name``; pause the operation count until the returned context exits."""
        counter = self

        @contextlib.contextmanager
        def launching():
            outer = counter._in_launch == 0
            if outer:
                counter.launches += 1
                counter.kernels[name] += 1
            counter._in_launch += 1
            try:
                yield
            finally:
                counter._in_launch -= 1
        return launching()

    def _wrap(self, cls, attr):
        original = cls.__dict__[attr]
        counter = self

        if attr == "run":
            def run(fn, *args, **kwargs):
                if kwargs.get("warmup"):
                    return original(fn, *args, **kwargs)
                with counter._launch(getattr(fn, "__name__", type(fn).__name__)):
                    return original(fn, *args, **kwargs)
            wrapped = run
        else:  # a compiled kernel's kernel[grid] returns the launcher
            def getitem(kernel, grid):
                launcher = original(kernel, grid)

                def launch(*args, **kwargs):
                    with counter._launch(getattr(kernel, "name", "compiled")):
                        return launcher(*args, **kwargs)
                return launch
            wrapped = getitem
        setattr(cls, attr, wrapped)
        self._patched.append((cls, attr, original))

    def __enter__(self):
        for cls, attr in _launch_entry_points():
            if attr in cls.__dict__:
                self._wrap(cls, attr)
        self._mode = _Dispatch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for cls, attr, original in reversed(self._patched):
            setattr(cls, attr, original)
        self._patched.clear()
        return False


def count_steps(step, steps: int) -> list[dict]:
    """``OpCount.summary()`` of each of ``steps`` calls of ``step``."""
    out = []
    for _ in range(steps):
        with OpCount() as c:
            step()
        out.append(c.summary())
    return out


def optimizer_options(name: str) -> dict:
    """Keyword options that put a registry optimizer on its Triton path (Gefen's variants)."""
    return {"backend": "triton"} if name.startswith("Gefen") else {}


def count_optimizer(name: str, tensors: int, steps: int = 3, seed: int = 0, device="cpu") -> list[dict]:
    """Counts of each of ``steps`` steps after the first of registry optimizer ``name`` on
    ``models.small_tensor_stack(tensors)`` with fixed gradients (one backward)."""
    from experiments.harness.models import model_loss, small_tensor_stack
    from experiments.harness.registry import make_optimizer

    torch.manual_seed(seed)
    model = small_tensor_stack(tensors).to(device)
    model_loss(model, torch.randn(16, 64, device=device)).backward()
    opt = make_optimizer(name, model, 1e-3, 0.1, **optimizer_options(name))
    opt.step()  # the first step sets blocks and the codebook: not a steady step
    return count_steps(opt.step, steps)


def count_in_child(names, tensor_counts, steps: int = 3, seed: int = 0, timeout: float = 1800) -> list[dict]:
    """``count_optimizer`` of each name at each tensor count on CPU tensors, in a child process with
    TRITON_INTERPRET=1 (the Triton path on the CPU). Records ``{"optimizer", "tensors", "steps": [summary]}``,
    or ``{"optimizer", "tensors", "error"}`` for one that failed."""
    cmd = module_cmd("experiments.harness.op_count", "--optimizers", *names, "--tensors", *tensor_counts,
                     "--steps", steps, "--seed", seed)
    run = run_child(cmd, cwd=REPO_ROOT, env=child_env(TRITON_INTERPRET=1), timeout=timeout)
    return run.check(" ".join(cmd)).result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", nargs="+", required=True, help="registry names")
    parser.add_argument("--tensors", nargs="+", type=int, default=[40, 160], help="tensor counts (multiples of 4)")
    parser.add_argument("--steps", type=int, default=3, help="counted steps after the first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    records = []
    for n in args.tensors:
        for name in args.optimizers:
            record = {"optimizer": name, "tensors": n}
            try:
                record["steps"] = count_optimizer(name, n, args.steps, args.seed, args.device)
            except Exception as exc:  # one optimizer that cannot run is reported, not fatal
                record["error"] = f"{type(exc).__name__}: {exc}"
            records.append(record)
    emit_result(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
