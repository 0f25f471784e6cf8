"""Disk Sparse Adam inside the idioms of training frameworks, each beside ``torch.optim.SparseAdam``.

What frameworks do to an optimizer: wrap it in an object that delegates attribute reads
(Lightning's ``LightningOptimizer``), move the model after the optimizer exists (transformers'
``Trainer``), re-create the optimizer from ``state_dict()["param_groups"][0]`` (PyKEEN), move every
tensor of ``opt.state`` to the device (Lightning, accelerate). And what careless code does: two
optimizers on one ``state_dir``, a table on ``meta``, odd values in a parameter group, a step cut
short by Ctrl-C, a mapped weight moved out of its file. The real frameworks are in
``tests/test_integration.py``.
"""

import gc

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam, DiskSparseRiemannianAdam, mapped_embedding
from optim.backends import numba_available
from optim.disk_sparse import torch_ops
from optim.disk_sparse.store import StateFileError
from optim.disk_sparse.weights import close_mapped
from tests.utils import sparse_embedding

ROWS, DIM = 50, 4


def _train(emb, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        emb(torch.randint(0, emb.num_embeddings, (16,), generator=gen)).pow(2).sum().backward()
        opt.step()


class _Delegating:
    """LightningOptimizer's construction: the wrapper's class subclasses the wrapped optimizer's, and
    attribute reads it does not have go to the wrapped optimizer."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type("Lightning" + type(optimizer).__name__, (type(self), type(optimizer)), {})

    def __getattr__(self, name):
        return getattr(self.__dict__["_optimizer"], name)


def test_a_collected_delegating_wrapper_leaves_the_optimizer_open(tmp_path):
    emb, ref = sparse_embedding(ROWS, DIM, seed=0), sparse_embedding(ROWS, DIM, seed=0)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1)
    sparse_adam = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    wrapper = _Delegating(opt)
    assert wrapper.state_dir == opt.state_dir  # it reads through to the optimizer
    del wrapper
    gc.collect()
    _train(emb, opt, 3)
    _train(ref, sparse_adam, 3)
    assert torch.equal(emb.weight, ref.weight)
    opt.close()


def test_a_collected_lightning_optimizer_leaves_the_optimizer_open():
    LightningOptimizer = pytest.importorskip("lightning.pytorch.core.optimizer").LightningOptimizer
    emb = sparse_embedding(ROWS, DIM, seed=0)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1)
    wrapper = LightningOptimizer(opt)
    del wrapper
    gc.collect()
    _train(emb, opt, 2)
    assert opt.step_count(emb.weight) == 2
    opt.close()


def test_a_table_on_meta_trains_once_materialised(tmp_path):
    """transformers' Trainer moves the model after the optimizer is built; the CPU stand-in is a
    model built on ``meta`` and materialised with ``to_empty`` (the same Parameter objects)."""
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with torch.device("meta"):
            emb = nn.Embedding(ROWS, DIM, sparse=True)
        opt = DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "s")
        with pytest.raises(RuntimeError, match="still on the meta device"):
            emb.weight.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, DIM), (ROWS, DIM),
                                                      device="meta")
            opt.step()
        emb.weight.grad = None
        param = emb.weight
        emb.to_empty(device="cpu")
        assert emb.weight is param  # swapped in place: the optimizer holds the same object
        ref = sparse_embedding(ROWS, DIM, seed=0)
        with torch.no_grad():
            emb.weight.copy_(ref.weight)
        sparse_adam = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
        _train(emb, opt, 3)
        _train(ref, sparse_adam, 3)
        assert opt.backend_of(emb.weight) in ("numba", "torch")
        assert torch.equal(emb.weight, ref.weight)
        opt.close()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_a_table_on_meta_chooses_a_named_backend_once_materialised(tmp_path):
    """``backend="numba"`` cannot run on the meta device, so a table built there has its backend
    chosen at its first step, on the device ``to_empty`` gave it; it then steps as SparseAdam."""
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with torch.device("meta"):
            emb = nn.Embedding(ROWS, DIM, sparse=True)
        opt = DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "s", backend="numba")
        emb.to_empty(device="cpu")
        ref = sparse_embedding(ROWS, DIM, seed=0)
        with torch.no_grad():
            emb.weight.copy_(ref.weight)
        _train(emb, opt, 3)
        _train(ref, torch.optim.SparseAdam(ref.parameters(), lr=0.1), 3)
        assert opt.backend_of(emb.weight) == "numba"
        assert torch.equal(emb.weight, ref.weight)
        opt.close()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


@pytest.mark.parametrize("cls,extra", [(DiskSparseAdam, dict(bitwise=False)), (DiskSparseRiemannianAdam, dict(c=0.5))])
def test_a_recreation_from_param_groups_keeps_every_option(tmp_path, cls, extra):
    """PyKEEN re-creates the optimizer as ``type(opt)(params, **param_groups[0] minus params)``."""
    emb = sparse_embedding(ROWS, DIM, seed=0)
    with torch.no_grad():
        emb.weight.mul_(0.01)
    opt = cls(emb.parameters(), lr=0.05, state_format="compact", backend="torch", staging=False,
              huge_pages=False, **extra)
    kwargs = {k: v for k, v in opt.state_dict()["param_groups"][0].items() if k != "params"}
    twin = cls(emb.parameters(), **kwargs)
    for name in ("state_format", "backend", "staging", "huge_pages"):
        assert getattr(twin, name) == getattr(opt, name), name
    assert twin.defaults == opt.defaults and twin.state_dir != opt.state_dir  # a new private directory
    for o in (twin, opt):
        o.close()
    fixed = cls(emb.parameters(), lr=0.05, state_dir=tmp_path / "s", **extra)
    kwargs = {k: v for k, v in fixed.state_dict()["param_groups"][0].items() if k != "params"}
    assert kwargs["state_dir"] == str(tmp_path / "s")
    with pytest.raises(StateFileError, match="in use by another optimizer"):
        cls(emb.parameters(), **kwargs)
    fixed.close()
    resumed = cls(emb.parameters(), **kwargs, resume=True)  # once closed, it continues the files
    resumed.close()


def test_two_optimizers_on_one_state_dir_are_told_the_truth(tmp_path):
    a = DiskSparseAdam(sparse_embedding(ROWS, DIM, seed=0).parameters(), state_dir=tmp_path)
    with pytest.raises(StateFileError, match="in use by another optimizer.*cannot share"):
        DiskSparseAdam(sparse_embedding(ROWS, DIM, seed=0).parameters(), state_dir=tmp_path)
    with pytest.raises(StateFileError, match="in use by another optimizer"):
        DiskSparseAdam(sparse_embedding(ROWS, DIM, seed=0).parameters(), state_dir=tmp_path, resume=True)
    a.close()


def test_the_state_holds_no_tables_between_steps(tmp_path):
    """Frameworks move every tensor of ``opt.state`` to the device (Lightning's
    ``_optimizer_to_device``) or round-trip ``state_dict()`` (accelerate): before the first step
    there is nothing (as SparseAdam), after it only the step; the state dict is SparseAdam's."""
    emb, ref = sparse_embedding(ROWS, DIM, seed=0), sparse_embedding(ROWS, DIM, seed=0)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "s")
    sparse_adam = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {} == sparse_adam.state_dict()["state"]
    opt.load_state_dict(opt.state_dict())  # accelerate's round trip before the first step
    _train(emb, opt, 2)
    _train(ref, sparse_adam, 2)
    assert opt.state[emb.weight] == {"step": 2}
    assert not any(torch.is_tensor(v) for st in opt.state.values() for v in st.values())
    ours, theirs = opt.state_dict()["state"][0], sparse_adam.state_dict()["state"][0]
    assert set(ours) == set(theirs) and all(torch.equal(torch.as_tensor(ours[k]), torch.as_tensor(theirs[k]))
                                            for k in ours)
    opt.close()


def test_group_values_are_checked_as_the_constructor_checks_them(tmp_path):
    emb, other = sparse_embedding(ROWS, DIM, seed=0), sparse_embedding(ROWS, DIM, seed=1)
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s")
    bad_groups = [dict(maximize="no"), dict(lr=-1.0), dict(betas=(1.5, 0.9)), dict(bitwise="no"),
                  dict(state_format="compact"), dict(state_dir=str(tmp_path / "t")), dict(backend="torch")]
    for bad in bad_groups:
        with pytest.raises(ValueError):
            opt.add_param_group(dict(params=[other.weight], **bad))
        assert len(opt.param_groups) == 1, bad
    opt.add_param_group(dict(params=[other.weight], lr=0.5))
    assert len(opt.state_files()) == 2
    opt.close()
    with pytest.raises(ValueError, match="resume"):
        DiskSparseAdam(sparse_embedding(ROWS, DIM, seed=0).parameters(), state_dir=tmp_path / "u", resume="yes")
    with pytest.raises(ValueError, match="resume=True.*state_dir"):
        DiskSparseAdam(sparse_embedding(ROWS, DIM, seed=0).parameters(), resume=True)


def test_compact_float64_is_not_told_to_use_the_backend_that_refused_it():
    table = nn.Embedding(10, 4, sparse=True).double()
    with pytest.raises(ValueError, match="state_format='exact'") as err:
        DiskSparseAdam(table.parameters(), state_format="compact", backend="torch")
    assert "use backend='torch'" not in str(err.value)


class _Interrupt(BaseException):
    """Stands in for KeyboardInterrupt (which pytest would take as the user's)."""


def test_an_interrupted_step_leaves_the_directory_dirty(tmp_path, monkeypatch):
    """A step cut short after one table's rows were written holds no one step: ``close`` (from
    ``with``) must not mark it clean, ``flush`` refuses, and reopening is refused."""
    real, calls = torch_ops.adam_rows_, []

    def second_call_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # step 2, table 2
            raise _Interrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_ops, "adam_rows_", second_call_interrupted)
    a, b = sparse_embedding(ROWS, DIM, seed=0), sparse_embedding(ROWS, DIM, seed=1)
    with pytest.raises(_Interrupt):
        with DiskSparseAdam([a.weight, b.weight], state_dir=tmp_path / "s", backend="torch") as opt:
            for _ in range(2):
                opt.zero_grad()
                (a(torch.tensor([1, 2])).sum() + b(torch.tensor([3])).sum()).backward()
                try:
                    opt.step()
                except _Interrupt:
                    with pytest.raises(StateFileError, match="interrupted"):
                        opt.flush()
                    raise
    monkeypatch.setattr(torch_ops, "adam_rows_", real)
    with pytest.raises(StateFileError, match="dirty"):
        DiskSparseAdam([a.weight, b.weight], state_dir=tmp_path / "s", resume=True)


def test_an_interrupted_load_leaves_the_directory_dirty(tmp_path, monkeypatch):
    from optim.disk_sparse.store import RowStateFile

    a, b = sparse_embedding(ROWS, DIM, seed=0), sparse_embedding(ROWS, DIM, seed=1)
    src = DiskSparseAdam([a.weight, b.weight], lr=0.1)
    _train(a, src, 2)
    sd = src.state_dict()
    real, calls = RowStateFile.write_all, []

    def interrupted_on_the_second_table(self, columns, step):
        calls.append(1)
        if len(calls) == 2:
            raise _Interrupt
        return real(self, columns, step)

    monkeypatch.setattr(RowStateFile, "write_all", interrupted_on_the_second_table)
    with pytest.raises(_Interrupt):
        with DiskSparseAdam([sparse_embedding(ROWS, DIM, seed=2).weight, sparse_embedding(ROWS, DIM, seed=3).weight], state_dir=tmp_path / "s") as dst:
            dst.load_state_dict(sd)
    monkeypatch.setattr(RowStateFile, "write_all", real)
    with pytest.raises(StateFileError, match="dirty"):
        DiskSparseAdam([sparse_embedding(ROWS, DIM, seed=2).weight, sparse_embedding(ROWS, DIM, seed=3).weight], state_dir=tmp_path / "s", resume=True)
    src.close()


@pytest.mark.parametrize("move", ["share_memory", "double"])
def test_a_mapped_weight_that_left_its_file_is_refused(tmp_path, move):
    emb = mapped_embedding(tmp_path / "w.dsa", ROWS, DIM)
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s")
    _train(emb, opt, 1)
    opt.zero_grad()
    getattr(emb, move)()
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="no longer lives in its file"):
        opt.step()
    assert opt.step_count(emb.weight) == 1  # refused before anything was written
    opt.close()
    close_mapped(emb)
