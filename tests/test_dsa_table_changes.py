"""Disk Sparse Adam's table changed behind its back: ``prefetch`` from a loader thread while the main
thread steps, the fused step's version bump seen by autograd, a second optimizer on one mapped
weight, a mapped module collected or pickled, a table cast or materialised into new parameters after
construction, a table changed under ``step_in_backward``. Each case either works as the reference
does (``torch.optim.SparseAdam``, or the same run without the change) or is refused with an error
that says what happened and what to do.
"""

import threading

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam, mapped_embedding
from optim.disk_sparse.store import StateFileError
from optim.disk_sparse.weights import close_mapped
from tests.utils import index_batches, run_python, step_rows

ROWS, DIM = 300, 6


def test_prefetch_from_a_loader_thread_equals_the_run_without_it(tmp_path):
    """The staged pipeline (``staging=True``), a loader thread announcing batch k+1 while the main
    thread steps batch k: weights and moments equal those of the run without announcements."""
    torch.manual_seed(0)
    a, b = nn.Embedding(ROWS, DIM, sparse=True), nn.Embedding(ROWS, DIM, sparse=True)
    b.load_state_dict(a.state_dict())
    plain = DiskSparseAdam(a.parameters(), lr=0.05, staging=True, state_dir=tmp_path / "a")
    staged = DiskSparseAdam(b.parameters(), lr=0.05, staging=True, state_dir=tmp_path / "b")
    batches = index_batches(60, ROWS)
    for idx in batches:
        step_rows(a, plain, idx)
    errors = []

    def loader(k):
        try:
            staged.prefetch(batches[k])
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    for k, idx in enumerate(batches):
        t = threading.Thread(target=loader, args=(k + 1,)) if k + 1 < len(batches) else None
        if t is not None:
            t.start()
        step_rows(b, staged, idx)
        if t is not None:
            t.join()
    assert not errors
    assert torch.equal(a.weight, b.weight)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(plain.state_dict()["state"][0][key], staged.state_dict()["state"][0][key])
    assert staged.staging_stats()["hits"] > 0
    plain.close()
    staged.close()


def test_the_fused_step_tells_autograd_the_weight_changed(tmp_path):
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s", backend="numba")
    out = emb(torch.tensor([1, 2]))
    saved = out * emb.weight[:2]  # a graph that saved the weight before the step
    before = emb.weight._version
    opt.zero_grad()
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    assert emb.weight._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()
    opt.close()


def test_a_second_optimizer_on_one_mapped_weight_is_refused(tmp_path):
    emb = mapped_embedding(tmp_path / "w.dsa", ROWS, DIM)
    first = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "a")
    with pytest.raises(StateFileError, match="already trained by another optimizer"):
        DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "b")
    first.close()
    second = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "b")  # once the first is closed
    second.close()
    close_mapped(emb)


def test_a_mapped_module_collected_or_pickled_is_explained(tmp_path):
    emb = mapped_embedding(tmp_path / "w.dsa", ROWS, DIM)
    with pytest.raises(TypeError, match="cannot be pickled with the module: save module.state_dict"):
        torch.save(emb, tmp_path / "m.pt")
    torch.save(emb.state_dict(), tmp_path / "sd.pt")  # the advice works
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s")
    close_mapped(emb)  # as when the module is garbage-collected
    with pytest.raises(StateFileError, match="garbage-collected or close_mapped"):
        step_rows(emb, opt, index_batches(1, ROWS)[0])
    for bad in (dict(num_embeddings=-5), dict(embedding_dim=0), dict(num_embeddings=2.5)):
        kw = {"num_embeddings": 10, "embedding_dim": 4, **bad}
        with pytest.raises(ValueError, match="must be a positive int"):
            mapped_embedding(tmp_path / "x.dsa", kw["num_embeddings"], kw["embedding_dim"])


@pytest.mark.parametrize("first,cast", [(torch.float32, "double"), (torch.float64, "float")],
                         ids=["float32-then-double", "float64-then-float"])
def test_a_dtype_cast_of_the_table_after_construction_is_refused(tmp_path, first, cast):
    """``emb.double()`` (or ``.float()``) after the optimizer was built: the step is refused naming
    the cast, in a subprocess since the kernels once ran over the mismatched buffers (heap overflow,
    segfault, NaN); the recipe the error gives (state_dict into a new optimizer) then steps as
    ``torch.optim.SparseAdam`` does after loading the same state dict into the cast table."""
    out = run_python(f"""
        import torch, torch.nn as nn
        from optim import DiskSparseAdam
        torch.manual_seed(0)
        emb = nn.Embedding(20000, 64, sparse=True).to({first})
        opt = DiskSparseAdam(emb.parameters(), lr=0.1, backend="numba", state_dir={str(tmp_path / "s")!r})
        def step(o, idx):
            o.zero_grad()
            emb(idx).pow(2).sum().backward()
            o.step()
        step(opt, torch.randint(0, 20000, (4096,)))
        emb.{cast}()
        try:
            step(opt, torch.randint(0, 20000, (4096,)))
            print("stepped", torch.isfinite(emb.weight).all().item())
        except RuntimeError as exc:
            print("refused:", exc)
        sd = opt.state_dict()
        ref = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
        ref.load_state_dict(sd)
        new = DiskSparseAdam(emb.parameters(), lr=0.1, backend="numba", state_dir={str(tmp_path / "t")!r})
        new.load_state_dict(sd)
        opt.close()
        w0 = emb.weight.detach().clone()
        idx = torch.randint(0, 20000, (4096,))
        step(ref, idx)
        w_ref = emb.weight.detach().clone()
        with torch.no_grad():
            emb.weight.copy_(w0)
        step(new, idx)
        print("recipe equal:", torch.equal(emb.weight, w_ref))
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused:" in out.stdout and "dtype changed" in out.stdout and "load_state_dict" in out.stdout, out.stdout
    assert "recipe equal: True" in out.stdout, out.stdout


def test_a_table_materialised_into_new_parameters_is_refused_at_the_step():
    """``module.to_empty`` without swapping gives the module new Parameter objects: the optimizer
    built on the meta table would step nothing, silently; its step is refused, saying to build the
    optimizer after ``to_empty``."""
    with torch.device("meta"):
        emb = nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1)
    emb.to_empty(device="cpu")
    nn.init.normal_(emb.weight)
    before = emb.weight.detach().clone()
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="still on the meta device.*Build the optimizer after module.to_empty"):
        opt.step()
    assert torch.equal(emb.weight, before)
    opt.close()


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("change", ["double", "bfloat16", "shape"])
def test_a_table_changed_under_step_in_backward_is_refused_at_its_backward(tmp_path, backend, change):
    """The step inside backward runs the step's checks in each parameter's hook: a cast of the table
    (``emb.double()``, ``emb.bfloat16()``) or a replaced ``p.data`` after ``step_in_backward`` was
    installed is refused at the next backward naming the change, and the weights and step count
    stay as they were (the kernels never see the mismatched buffers)."""
    if backend == "numba":
        pytest.importorskip("numba")
    from optim import step_in_backward

    emb = nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1, backend=backend, state_dir=tmp_path / "s")
    idx = torch.tensor([1, 2, 2, ROWS - 1])
    with step_in_backward(opt):
        emb(idx).pow(2).sum().backward()
        stepped = emb.weight.detach().clone()
        assert opt.step_count(emb.weight) == 1 and not torch.equal(stepped[1], torch.zeros(DIM))
        if change == "shape":
            emb.weight.data = torch.zeros(ROWS + 3, DIM)
        else:
            getattr(emb, change)()
        expected = {"double": "dtype changed from torch.float32 to torch.float64",
                    "bfloat16": "dtype changed from torch.float32 to torch.bfloat16",
                    "shape": r"shape changed from \(300, 6\) to \(303, 6\)"}[change]
        with pytest.raises(RuntimeError, match=expected):
            emb(idx).pow(2).sum().backward()
    assert opt.step_count(emb.weight) == 1
    if change in ("double", "bfloat16"):
        assert torch.equal(emb.weight.detach().float(), stepped.to(emb.weight.dtype).float())
    opt.close()
