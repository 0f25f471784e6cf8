"""pytest plugin: the kernel tests check the compiled Triton kernels on a GPU, unchanged.

    TRITON_INTERPRET=0 python -m pytest -p tests._device_launchers tests/test_dsa_kernels.py \
        tests/test_gefen_kernels.py -k "(triton or gefen_kernels) and not bad_inputs and not optimizer"

The kernel tests build CPU tensors and compare with CPU references. Loaded with ``-p``, this plugin
wraps each Triton launcher (``triton_ops.adam_rows_``, ``riemannian_adam_rows_``, ``gefen_step_``):
the storages of its tensor arguments are copied to ``$LAUNCHER_DEVICE`` (Default: cuda) with the
same offsets, strides and aliasing (so misaligned views stay misaligned), the launcher runs there,
and the storages are copied back. Tests of refusals and of the optimizer's backend choice, which
depend on where the tensors live, are deselected by the command above. Without the device every
test is skipped. ``LAUNCHER_DEVICE=cpu`` with ``TRITON_INTERPRET=1`` checks the plugin itself.
"""

import functools
import os

import pytest

DEVICE = os.environ.get("LAUNCHER_DEVICE", "cuda")
os.environ.setdefault("TRITON_INTERPRET", "0" if DEVICE == "cuda" else "1")  # before triton's import

import torch  # noqa: E402

HOST_ARGS = {"codebook", "tables"}  # the launcher builds its device tables from these itself


def _device_storage(st):
    return torch.empty(0, dtype=torch.uint8).set_(st).to(DEVICE, copy=True).untyped_storage()


def _mirror(x, storages):
    """``x`` with every CPU tensor replaced by a view of a device copy of its storage."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        st = x.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in storages:
            storages[key] = (st, _device_storage(st))
        return torch.empty(0, dtype=x.dtype, device=DEVICE).set_(storages[key][1], x.storage_offset(),
                                                                 x.size(), x.stride())
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a record (``plan.Tile``, ``plan.Hyper``)
        return type(x)(*(_mirror(y, storages) for y in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_mirror(y, storages) for y in x)
    return x


def on_device(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        storages = {}
        host = 2 if fn.__name__ == "gefen_step_" else None  # gefen_step_'s codebook, as HOST_ARGS
        args = [a if i == host else _mirror(a, storages) for i, a in enumerate(args)]
        kwargs = {k: v if k in HOST_ARGS else _mirror(v, storages) for k, v in kwargs.items()}
        out = fn(*args, **kwargs)
        for host, dev in storages.values():
            host.copy_(torch.empty(0, dtype=torch.uint8, device=dev.device).set_(dev).cpu().untyped_storage())
        return out
    return run


def pytest_configure(config):
    from optim.disk_sparse import triton_ops as dsa
    from optim.gefen import triton_ops as gefen

    for mod, name in ((dsa, "adam_rows_"), (dsa, "riemannian_adam_rows_"), (gefen, "gefen_step_")):
        setattr(mod, name, on_device(getattr(mod, name)))


def pytest_collection_modifyitems(config, items):
    if DEVICE == "cuda" and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device for the compiled kernels")
        for item in items:
            item.add_marker(skip)
