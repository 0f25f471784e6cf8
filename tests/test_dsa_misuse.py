"""Disk Sparse Adam against what a careless user or an adversary does: a kill while a weight file is
filled, state files deleted or replaced under an open optimizer, ``prefetch`` from a loader thread
while the main thread steps, odd indices and state dicts, a second optimizer on one mapped weight,
a mapped module collected or pickled, a resume on another number of ranks, a save and restore of a
state larger than the memory limit, a table cast under ``step_in_backward``. Each case either works
as the reference does (``torch.optim.SparseAdam``, or the same run without the misuse) or is refused
with an error that says what happened and what to do.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam, mapped_embedding
from optim.disk_sparse.store import StateFileError
from optim.disk_sparse.weights import close_mapped

ROWS, DIM = 300, 6
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _batches(n, seed=1, rows=ROWS):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, rows, (40,), generator=gen) for _ in range(n)]


def _step(emb, opt, idx):
    opt.zero_grad()
    emb(idx).pow(2).sum().backward()
    opt.step()


def test_a_kill_while_a_weight_file_is_filled_leaves_it_refused(tmp_path):
    path = tmp_path / "w.dsa"
    out = _run(f"""
        import os, signal
        from optim.disk_sparse import weights
        real = weights._fill_normal
        def killed_half_way(records, std, seed, chunk_rows=1 << 16):
            real(records[: records.shape[0] // 2], std, seed)
            os.kill(os.getpid(), signal.SIGKILL)
        weights._fill_normal = killed_half_way
        weights.mapped_embedding({str(path)!r}, 4000, 8)
    """)
    assert out.returncode == -signal.SIGKILL, out.stderr
    with pytest.raises(StateFileError, match="dirty"):
        mapped_embedding(path, 4000, 8)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_state_file_deleted_or_replaced_under_the_optimizer_is_refused(tmp_path, how):
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s")
    _step(emb, opt, _batches(1)[0])
    path = opt.state_file(emb.weight).path
    os.unlink(path)
    if how == "replaced":
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    with pytest.raises(StateFileError, match=how):
        opt.flush()
    with pytest.raises(StateFileError, match=how):
        opt.close()
    assert opt._closed  # released all the same: nothing is locked or mapped any more


def test_prefetch_from_a_loader_thread_equals_the_run_without_it(tmp_path):
    """The staged pipeline (``staging=True``), a loader thread announcing batch k+1 while the main
    thread steps batch k: weights and moments equal those of the run without announcements."""
    torch.manual_seed(0)
    a, b = nn.Embedding(ROWS, DIM, sparse=True), nn.Embedding(ROWS, DIM, sparse=True)
    b.load_state_dict(a.state_dict())
    plain = DiskSparseAdam(a.parameters(), lr=0.05, staging=True, state_dir=tmp_path / "a")
    staged = DiskSparseAdam(b.parameters(), lr=0.05, staging=True, state_dir=tmp_path / "b")
    batches = _batches(60)
    for idx in batches:
        _step(a, plain, idx)
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
        _step(b, staged, idx)
        if t is not None:
            t.join()
    assert not errors
    assert torch.equal(a.weight, b.weight)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(plain.state_dict()["state"][0][key], staged.state_dict()["state"][0][key])
    assert staged.staging_stats()["hits"] > 0
    plain.close()
    staged.close()


def test_prefetch_takes_any_integer_indices_and_refuses_others(tmp_path):
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s")
    import numpy as np

    for idx in ([1, 2, 3], np.array([4, 5]), 7, torch.tensor([8], dtype=torch.int32)):
        opt.prefetch(idx)
    for bad in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([1 + 1j])):
        with pytest.raises(TypeError, match="integers"):
            opt.prefetch(bad)
    opt.close()


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


def test_odd_state_dicts_are_explained(tmp_path):
    opt = DiskSparseAdam(nn.Embedding(ROWS, DIM, sparse=True).parameters(), state_dir=tmp_path / "s")
    with pytest.raises(TypeError, match="takes a state dict"):
        opt.load_state_dict(None)
    with pytest.raises(ValueError, match="lacks 'state' and 'param_groups'"):
        opt.load_state_dict({})
    opt.close()


def test_a_mapped_module_collected_or_pickled_is_explained(tmp_path):
    emb = mapped_embedding(tmp_path / "w.dsa", ROWS, DIM)
    with pytest.raises(TypeError, match="cannot be pickled with the module: save module.state_dict"):
        torch.save(emb, tmp_path / "m.pt")
    torch.save(emb.state_dict(), tmp_path / "sd.pt")  # the advice works
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s")
    close_mapped(emb)  # as when the module is garbage-collected
    with pytest.raises(StateFileError, match="garbage-collected or close_mapped"):
        _step(emb, opt, _batches(1)[0])
    for bad in (dict(num_embeddings=-5), dict(embedding_dim=0), dict(num_embeddings=2.5)):
        kw = {"num_embeddings": 10, "embedding_dim": 4, **bad}
        with pytest.raises(ValueError, match="must be a positive int"):
            mapped_embedding(tmp_path / "x.dsa", kw["num_embeddings"], kw["embedding_dim"])


def test_resume_on_another_number_of_ranks_is_refused(tmp_path):
    (tmp_path / "state" / "rank0-of-2").mkdir(parents=True)
    out = _run(f"""
        import torch.distributed as dist
        from optim.disk_sparse.sharded import ShardedEmbedding, open_optimizer
        from optim.disk_sparse.store import StateFileError
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
        emb = ShardedEmbedding(10, 4)
        try:
            open_optimizer(emb, {str(tmp_path / "state")!r}, resume=True)
        except StateFileError as exc:
            print("refused:", exc)
        dist.destroy_process_group()
    """)
    assert "refused:" in out.stdout and "another number of ranks" in out.stdout and "DCP" in out.stdout, \
        out.stdout + out.stderr


def test_resume_knows_tables_by_name_and_refuses_extra_files(tmp_path):
    """Two same-shape tables given by name: resumed in the other order they are refused (by
    position they would swap moments silently); a resume that leaves state files out is refused."""
    a, b = nn.Embedding(ROWS, DIM, sparse=True), nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam([("a.weight", a.weight), ("b.weight", b.weight)], state_dir=tmp_path / "s")
    opt.zero_grad()
    (a(torch.tensor([1])).sum() + b(torch.tensor([2])).sum()).backward()
    opt.step()
    opt.close()
    with pytest.raises(StateFileError, match="holds the state of parameter 'a.weight'.*'b.weight'.*another order"):
        DiskSparseAdam([("b.weight", b.weight), ("a.weight", a.weight)], state_dir=tmp_path / "s", resume=True)
    with pytest.raises(StateFileError, match="more parameters than this optimizer has.*param0001.dsa"):
        DiskSparseAdam([("a.weight", a.weight)], state_dir=tmp_path / "s", resume=True)
    again = DiskSparseAdam([("a.weight", a.weight), ("b.weight", b.weight)], state_dir=tmp_path / "s", resume=True)
    assert again.step_count(a.weight) == again.step_count(b.weight) == 1
    again.close()


def test_sharded_weight_files_are_flushed_with_the_state(tmp_path):
    """A ShardedEmbedding's weight shard is a weight file like mapped_embedding's: flush() writes it
    clean at the optimizer's step; a process killed after more steps leaves it dirty (refused)."""
    from optim.disk_sparse.weights import WeightFile

    out = _run(f"""
        import os, signal, torch, torch.distributed as dist
        from optim.disk_sparse.sharded import ShardedEmbedding, open_optimizer
        from optim.disk_sparse.weights import weight_file
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
        emb = ShardedEmbedding(100, 4, weight_dir={str(tmp_path / "w")!r})
        opt = open_optimizer(emb, {str(tmp_path / "s")!r}, lr=0.1)
        def step():
            opt.zero_grad()
            emb(torch.tensor([1, 2, 3])).sum().backward()
            opt.step()
        for _ in range(3):
            step()
        opt.flush()
        print("clean at", weight_file(emb.weight).step, flush=True)
        step()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert "clean at 3" in out.stdout, out.stdout + out.stderr
    with pytest.raises(StateFileError, match="dirty"):
        WeightFile(str(tmp_path / "w" / "rank0-of-1.float32.weight"), 100, 4, torch.float32)


def _run_in_memory_cgroup(code, limit_bytes, timeout=120):
    """Run ``code`` in a child that joins a new memory cgroup of ``limit_bytes`` (page cache
    included) once it has imported what an optimizer needs (a throwaway DiskSparseAdam pulls in
    torch's optimizer machinery, some 250 MiB of imports), so that only what ``code`` allocates
    counts; the cgroup is removed after. Returns the CompletedProcess and the cgroup's peak usage."""
    from experiments.memcg import make_memory_cgroup, remove_memory_cgroup

    cg = make_memory_cgroup("dsa-test", limit_bytes)
    if cg is None:
        pytest.skip("needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    prelude = f"""
        import os, torch
        from optim import DiskSparseAdam
        DiskSparseAdam([torch.nn.Parameter(torch.zeros(2, 2))]).close()
        with open({os.path.join(cg, "cgroup.procs")!r}, "w") as f:
            f.write(str(os.getpid()))
    """
    try:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(code)],
                             capture_output=True, text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))
        with open(os.path.join(cg, "memory.max_usage_in_bytes")) as f:
            peak = int(f.read())
    finally:
        assert remove_memory_cgroup(cg), f"memory cgroup {cg} could not be removed"
    return out, peak


def _random_state(state_format: str, rows: int, dim: int, gen) -> dict:
    """A state of ``state_format`` for a ``rows x dim`` table, drawn from ``gen``."""
    if state_format == "exact":
        return {"exp_avg": torch.rand(rows, dim, generator=gen) - 0.5, "exp_avg_sq": torch.rand(rows, dim, generator=gen)}
    return {"exp_avg_codes": torch.randint(-127, 128, (rows, dim), generator=gen, dtype=torch.int8),
            "exp_avg_scale": torch.rand(rows, 1, generator=gen), "exp_avg_sq": torch.rand(rows, 1, generator=gen)}


def test_states_larger_than_the_memory_limit_restore_and_save_within_it(tmp_path):
    """The routes the error messages give for out-of-core tables, in a child whose memory cgroup
    (16 MiB, page cache included) is a fraction of each state (exact 64 MiB, compact 36 MiB): the
    restore ``opt.load_state_dict(torch.load(ckpt, mmap=True))`` checks and writes the rows in
    chunks, and ``torch.save(opt.state_dict(), ...)`` streams mappings of the files; the child
    exits 0 and each saved state equals its checkpoint on 500 random rows. A restore that holds a
    whole state at once (torch.load without mmap; the compact codes' range checked in one mask)
    is killed for memory."""
    from optim import mapped_embedding

    gen, limit = torch.Generator().manual_seed(3), 16 << 20
    tables = {"exact": (131_072, 64), "compact": (524_288, 64)}
    states, lines = {}, []
    for fmt, (rows, dim) in tables.items():
        states[fmt] = _random_state(fmt, rows, dim, gen)
        groups = DiskSparseAdam([nn.Parameter(torch.zeros(2, dim))], state_format=fmt).state_dict()["param_groups"]
        torch.save({"state": {0: {"step": 7, **states[fmt]}}, "param_groups": groups}, tmp_path / f"{fmt}.pt")
        close_mapped(mapped_embedding(tmp_path / f"{fmt}.w", rows, dim))  # the weights, in a file, made here
        lines.append(f"""
            emb = mapped_embedding({str(tmp_path / f"{fmt}.w")!r}, {rows}, {dim})
            opt = DiskSparseAdam(emb.parameters(), state_dir={str(tmp_path / fmt)!r}, state_format={fmt!r})
            opt.load_state_dict(torch.load({str(tmp_path / f"{fmt}.pt")!r}, mmap=True))
            torch.save(opt.state_dict(), {str(tmp_path / f"{fmt}.saved.pt")!r})
            print({fmt!r}, "restored and saved at step", opt.step_count(emb.weight), flush=True)
            opt.close()
        """)
    out, peak = _run_in_memory_cgroup("from optim import DiskSparseAdam, mapped_embedding\n"
                                      + "".join(textwrap.dedent(line) for line in lines), limit)
    assert out.returncode == 0, (out.returncode, peak, out.stdout, out.stderr[-2000:])
    assert peak <= limit
    for fmt, (rows, _) in tables.items():
        assert f"{fmt} restored and saved at step 7" in out.stdout, out.stdout
        saved = torch.load(tmp_path / f"{fmt}.saved.pt", mmap=True)["state"][0]
        sample = torch.randint(0, rows, (500,), generator=gen)
        assert int(saved["step"]) == 7
        for key, value in states[fmt].items():
            assert torch.equal(saved[key][sample], value[sample]), (fmt, key)


def test_a_compact_state_larger_than_memory_saves_without_a_copy(tmp_path, monkeypatch):
    """Where the compact state does not fit in memory, state_dict() gives each key its own mapping of
    the file instead of copies (torch.save cannot save one storage as several dtypes); the saved
    checkpoint loads into a new optimizer with the same state."""
    from optim.disk_sparse import base

    monkeypatch.setattr(base, "fits_in_page_cache", lambda nbytes: False)
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), state_format="compact", state_dir=tmp_path / "a")
    for idx in _batches(3):
        _step(emb, opt, idx)
    sd = opt.state_dict()
    st = sd["state"][0]
    ptrs = {st[k].untyped_storage().data_ptr() for k in ("exp_avg_scale", "exp_avg_sq", "exp_avg_codes")}
    assert len(ptrs) == 3  # one mapping each, no shared storage of several dtypes
    torch.save(sd, tmp_path / "ckpt.pt")
    twin = DiskSparseAdam(nn.Embedding(ROWS, DIM, sparse=True).parameters(), state_format="compact",
                          state_dir=tmp_path / "b")
    twin.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    back = twin.state_dict()["state"][0]
    for key in ("step", "exp_avg_scale", "exp_avg_sq", "exp_avg_codes"):
        assert torch.equal(torch.as_tensor(back[key]), torch.as_tensor(st[key])), key
    opt.close()
    twin.close()


@pytest.mark.parametrize("first,cast", [(torch.float32, "double"), (torch.float64, "float")],
                         ids=["float32-then-double", "float64-then-float"])
def test_a_dtype_cast_of_the_table_after_construction_is_refused(tmp_path, first, cast):
    """``emb.double()`` (or ``.float()``) after the optimizer was built: the step is refused naming
    the cast, in a subprocess since the kernels once ran over the mismatched buffers (heap overflow,
    segfault, NaN); the recipe the error gives (state_dict into a new optimizer) then steps as
    ``torch.optim.SparseAdam`` does after loading the same state dict into the cast table."""
    out = _run(f"""
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


def test_the_numba_kernels_refuse_buffers_of_mismatched_dtype_or_shape():
    """The kernels index without bounds checks and call torch's sqrt on raw pointers: a mismatch at
    their boundary is a TypeError or ValueError, never a run over the buffers."""
    pytest.importorskip("numba")
    from optim.disk_sparse import numba_ops

    w = torch.randn(50, 8, dtype=torch.float64)
    idx, vals = torch.tensor([1, 2, 2]), torch.randn(3, 8, dtype=torch.float64)
    hyper = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)
    with pytest.raises(TypeError, match="one dtype"):
        numba_ops.adam_sparse_(w, idx, vals, torch.zeros(50, 16), 1, **hyper)
    with pytest.raises(ValueError, match=r"records \(50, 16\)"):
        numba_ops.adam_sparse_(w, idx, vals, torch.zeros(50, 8, dtype=torch.float64), 1, **hyper)
    with pytest.raises(ValueError, match=r"records \(50, 16\)"):
        numba_ops.adam_sparse_(w, idx, vals, torch.zeros(10, 16, dtype=torch.float64), 1, **hyper)
    with pytest.raises(ValueError, match="int64"):
        numba_ops.adam_sparse_(w, idx.int(), vals, torch.zeros(50, 16, dtype=torch.float64), 1, **hyper)
    with pytest.raises(TypeError, match="one dtype"):
        numba_ops.adam_rows_(w[:3], vals.float(), torch.zeros(3, 16, dtype=torch.float64), 1, **hyper)
    with pytest.raises(TypeError, match="one dtype"):
        numba_ops.riemannian_adam_rows_(w[:3] * 0.01, vals.float(), torch.zeros(3, 9, dtype=torch.float64), 1,
                                        c=1.0, exact=False, **hyper)


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


def test_a_resume_of_unnamed_tables_in_another_order_is_refused(tmp_path):
    """Two same-shape tables given without names: resumed in the other order they would swap
    moments and steps silently; the weights' fingerprints recorded at close tell, and the resume
    is refused naming both files. In the trained order it resumes."""
    a, b = nn.Embedding(ROWS, DIM, sparse=True), nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam([a.weight, b.weight], state_dir=tmp_path / "s")
    for _ in range(2):
        opt.zero_grad()
        (a(torch.tensor([1, 5])).sum() + b(torch.tensor([2])).sum()).backward()
        opt.step()
    opt.zero_grad()
    a(torch.tensor([3])).sum().backward()
    opt.step()
    opt.close()
    with pytest.raises(StateFileError, match=r"parameter 0.*param0001\.dsa \(parameter 1\).*another order"):
        DiskSparseAdam([b.weight, a.weight], state_dir=tmp_path / "s", resume=True)
    again = DiskSparseAdam([a.weight, b.weight], state_dir=tmp_path / "s", resume=True)
    assert (again.step_count(a.weight), again.step_count(b.weight)) == (3, 2)
    again.close()


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
