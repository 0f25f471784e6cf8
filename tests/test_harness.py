"""The experiments' shared harness: child processes (experiments/harness/child.py)."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest

from experiments.harness.child import child_env, emit_result, free_port, module_cmd, parse_result, run_child
from experiments.harness.common import REPO_ROOT
from experiments.harness.memcg import largest_that_fits


def _py(code):
    return [sys.executable, "-c", code]


def test_child_result_is_its_last_result_line_among_other_output():
    value = {"rate": 1.5, "steps": [1, 2], "name": "RESULT {not json}"}
    code = ("import json, sys\n"
            "print('{\"a looks\": \"like json\"}'); print('RESULT ' + json.dumps(0))\n"
            "print('progress', file=sys.stderr)\n"
            "from experiments.harness.child import emit_result\n"
            f"emit_result({value!r}); print('done')\n")
    run = run_child(_py(code), env=child_env(), timeout=60)
    assert run.outcome == "ok" and run.result == value
    assert "progress" in run.stderr and not run.limited and run.peak_bytes == 0


def test_child_without_a_result_line_gives_none():
    assert parse_result("{\"x\": 1}\n42\n") is None
    assert run_child(_py("print(3)"), timeout=60).result is None


def test_emit_result_round_trips_through_parse(capsys):
    emit_result([1, {"b": None}])
    assert parse_result("noise\n" + capsys.readouterr().out) == [1, {"b": None}]


def test_child_failure_names_what_failed_and_its_stderr():
    run = run_child(_py("import sys; print('RESULT 1'); sys.exit('broken input')"), timeout=60)
    assert run.outcome == "exit 1" and run.result is None  # a result printed before a failure is not one
    assert run.why() == "exit 1: broken input"
    with pytest.raises(RuntimeError, match=r"(?s)the probe failed \(exit 1\).*broken input"):
        run.check("the probe")


def test_child_past_its_timeout_is_killed_and_says_timeout():
    run = run_child(_py("import time; time.sleep(30)"), timeout=0.5)
    assert run.returncode is None and run.outcome == "timeout" and run.result is None
    with pytest.raises(RuntimeError, match="timeout"):
        run.check("sleeper")


def test_child_env_puts_this_checkout_first_and_sets_extras(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = child_env(RANK=3, EXTRA="x")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/elsewhere"]
    assert env["RANK"] == "3" and env["EXTRA"] == "x"
    assert child_env({"PATH": "/bin"}) == {"PATH": "/bin", "PYTHONPATH": str(REPO_ROOT)}


def test_module_cmd_runs_a_module_of_this_checkout_with_this_interpreter():
    cmd = module_cmd("experiments.harness.child", "--x", 3)
    assert cmd == [sys.executable, "-m", "experiments.harness.child", "--x", "3"]


def test_free_port_can_be_listened_on():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        s.listen()


def test_child_in_a_memory_cgroup_sets_its_path_or_runs_unlimited():
    """Without the rights to make a cgroup the child still runs, unlimited, with MEMCG_PATH empty;
    with them it runs inside one (its peak measured) that is removed afterwards."""
    from experiments.harness import memcg

    code = "import os, json; from experiments.harness.child import emit_result; emit_result(os.environ['MEMCG_PATH'])"
    run = run_child(_py(code), env=child_env(), memory=("harness-test", 256 * 2**20), timeout=60)
    assert run.outcome == "ok" and run.limited == memcg.cgroups_usable()
    if run.limited:
        assert run.result and run.peak_bytes > 0 and not os.path.exists(run.result)
    else:
        assert run.result == "" and run.peak_bytes == 0


def test_a_cgroup_left_by_a_killed_parent_is_removed_at_the_next_one():
    """A parent SIGKILLed while its trial's cgroup existed leaves ``<name>-<pid>-<n>`` behind; the
    next cgroup of that name removes it (empty, its pid gone), but keeps one of that dead pid's name
    that a live process is still in."""
    import signal
    import subprocess
    import sys

    from experiments.harness import memcg

    if not memcg.cgroups_usable():
        pytest.skip("making memory cgroups needs root and the v1 controller")
    code = ("import time; from experiments.harness.memcg import make_memory_cgroup; "
            "print(make_memory_cgroup('harness-orphan', 2**26), flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=child_env())
    orphan = parent.stdout.readline().strip()
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    busy = os.path.join(memcg.CGROUP_ROOT, f"harness-orphan-{parent.pid}-999")
    os.makedirs(busy)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        memcg.join_memory_cgroup(busy, holder.pid)
        assert os.path.isdir(orphan)
        fresh = memcg.make_memory_cgroup("harness-orphan", 2**26)
        assert not os.path.exists(orphan) and os.path.isdir(busy) and os.path.isdir(fresh)
        assert memcg.remove_memory_cgroup(fresh)
    finally:
        holder.kill()
        holder.wait()
        assert memcg.remove_memory_cgroup(busy)


def test_parse_result_reads_json_values():
    assert parse_result("RESULT " + json.dumps({"x": [1.0]})) == {"x": [1.0]}


def test_resident_set_helpers_see_memory_touched_and_freed():
    """experiments/harness/peak.py's public RSS helpers against a 64 MiB buffer this test touches and frees."""
    import numpy as np

    from experiments.harness.peak import peak_rss_bytes, reset_peak_rss, rss_bytes

    size = 64 * 2**20
    before = rss_bytes()
    buf = np.ones(size, dtype=np.uint8)  # every page written
    held = rss_bytes()
    assert held - before > 0.9 * size
    assert peak_rss_bytes() >= held
    del buf
    if reset_peak_rss():  # Linux with clear_refs: the mark drops back to what is resident now
        assert peak_rss_bytes() < held - 0.5 * size


def test_random_offsets_are_page_aligned_inside_the_file_past_its_header():
    from experiments.harness.disk import PAGE, random_offsets

    size = 37 * PAGE + 100  # the tail's partial page is not a whole page to read
    offs = random_offsets(size, 2000, seed=3)
    assert len(offs) == 2000 and all(o % PAGE == 0 and PAGE <= o <= size - PAGE for o in offs)
    assert len(set(offs)) == 36  # every page but the header is drawn (2000 draws of 36)
    assert offs == random_offsets(size, 2000, seed=3) != random_offsets(size, 2000, seed=4)
    with pytest.raises(ValueError, match="two pages or more"):
        random_offsets(PAGE + 1, 1, seed=0)


@pytest.mark.parametrize("threads", [1, 4])
def test_random_read_rate_reads_the_file_and_counts_the_reads(tmp_path, monkeypatch, threads):
    """Every offset is read once, with one 4 KiB pread, on the file asked for, whatever the threads."""
    from experiments.harness import disk

    path = tmp_path / "f"
    path.write_bytes(os.urandom(64 * disk.PAGE))
    seen, real = [], os.pread
    monkeypatch.setattr(disk.os, "pread", lambda fd, n, off: seen.append((n, off)) or real(fd, n, off))
    rate = disk.random_read_rate(path, 500, seed=1, threads=threads)
    assert rate > 0
    assert sorted(seen) == sorted((disk.PAGE, o) for o in disk.random_offsets(64 * disk.PAGE, 500, seed=1))


def test_distmult_loss_is_the_logistic_loss_of_its_triple_scores():
    """experiments/harness/models.py's DistMult against the formula written out per triple."""
    import torch
    import torch.nn.functional as F

    from experiments.harness.models import DistMult

    torch.manual_seed(0)
    model = DistMult(50, 7, 8, init_std=0.1)
    assert model.ent.sparse and model.rel.sparse
    assert 0.05 < float(model.ent.weight.detach().std()) < 0.15
    h, r, t = torch.randint(0, 50, (5,)), torch.randint(0, 7, (5,)), torch.randint(0, 50, (5,))
    neg = torch.randint(0, 50, (5, 3))
    E, R = model.ent.weight.detach(), model.rel.weight.detach()
    pos = [float((E[h[i]] * R[r[i]] * E[t[i]]).sum()) for i in range(5)]
    negs = [float((E[h[i]] * R[r[i]] * E[neg[i, j]]).sum()) for i in range(5) for j in range(3)]
    want = (sum(F.softplus(torch.tensor(-s)) for s in pos) / 5 + sum(F.softplus(torch.tensor(s)) for s in negs) / 15)
    torch.testing.assert_close(model.loss(h, r, t, neg).detach(), want.float(), rtol=1e-5, atol=1e-6)


def test_sparse_embedding_models_give_sparse_gradients_on_the_rows_used():
    import torch

    from experiments.harness.models import DistMult, EmbeddingSquare

    torch.manual_seed(0)
    model = EmbeddingSquare(100, 4)
    idx = torch.tensor([3, 3, 9])
    model.loss(idx).backward()
    w = model.emb.weight
    torch.testing.assert_close(model.loss(idx).detach(), (w[idx] ** 2).mean().detach())
    g = model.emb.weight.grad
    assert g.is_sparse and set(g.coalesce().indices()[0].tolist()) == {3, 9}
    kg = DistMult(20, 3, 4)  # nn.Embedding's N(0, 1) without init_std
    assert 0.7 < float(kg.ent.weight.detach().std()) < 1.3


@pytest.mark.parametrize("width,depth", [(8, 1), (16, 3)])
def test_mlp_stack_has_depth_square_layers(width, depth):
    import torch

    from experiments.harness.models import mlp_stack

    model = mlp_stack(width, depth)
    assert sum(p.numel() for p in model.parameters()) == depth * (width * width + width)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert len(linears) == depth and len(model) == 2 * depth - 1  # no activation after the last layer
    assert model(torch.randn(2, width)).shape == (2, width)


def test_dsa_state_bytes_per_row_is_what_a_state_file_grows_by_per_row(tmp_path):
    """registry.dsa_state_bytes_per_row against the sizes of real state files: each file is one
    fixed header plus that many bytes a row, in both formats, at dimensions that do and do not
    divide a record's alignment."""
    import torch

    from experiments.harness.registry import dsa_state_bytes_per_row
    from optim import DiskSparseAdam

    headers = set()
    for fmt in ("exact", "compact"):
        for rows, dim in ((1000, 64), (3000, 13)):
            with DiskSparseAdam([torch.empty(rows, dim)], state_dir=tmp_path / f"{fmt}{dim}", state_format=fmt) as opt:
                size = os.path.getsize(opt.state_files()[0].path)
            headers.add(size - rows * dsa_state_bytes_per_row(dim, fmt))
    assert len(headers) == 1 and 0 <= headers.pop() <= 65536


def test_ranks_run_at_once_with_their_rank_and_one_free_port():
    """run_ranks' children meet each other (a barrier over files only passes if all run at once) and
    see the torch.distributed variables of one job."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        code = ("import os, time, pathlib; from experiments.harness.child import emit_result\n"
                f"d = pathlib.Path({tmp!r}); (d / os.environ['RANK']).touch()\n"
                "t = time.time()\n"
                "while len(list(d.iterdir())) < int(os.environ['WORLD_SIZE']) and time.time() - t < 20: time.sleep(0.01)\n"
                "emit_result({k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')}"
                " | {'met': len(list(d.iterdir()))})")
        from experiments.harness.child import run_ranks

        runs = run_ranks(_py(code), 3, env=child_env(), timeout=60)
    outs = [r.check("rank").result for r in runs]
    assert [o["RANK"] for o in outs] == ["0", "1", "2"]
    assert all(o["WORLD_SIZE"] == "3" and o["met"] == 3 and o["MASTER_ADDR"] == "127.0.0.1" for o in outs)
    assert len({o["MASTER_PORT"] for o in outs}) == 1


def test_stdlib_hierarchy_child_gives_the_is_a_edges_of_the_modules_asked_for():
    """experiments/harness/data.py's class hierarchy, collected in an isolated child, against the same
    classes' ``__mro__`` read here."""
    import numbers

    from experiments.harness.data import stdlib_hierarchy

    names, edges, info = stdlib_hierarchy(timeout=60, modules=["numbers"])
    pairs = {(names[a], names[b]) for a, b in edges.tolist()}
    for cls in (numbers.Integral, numbers.Real, numbers.Complex):
        for base in cls.__mro__[1:]:
            assert (f"numbers.{cls.__qualname__}", f"{base.__module__}.{base.__qualname__}") in pairs
    assert info["modules"] >= 1 and info["python"] == sys.version.split()[0]


@pytest.mark.parametrize("boundary, start", [(37, 4), (37, 200), (1, 5), (500, 3)])
def test_budget_search_brackets_the_largest_fitting_size(boundary, start):
    tried = []

    def fits(x):
        tried.append(x)
        return x <= boundary

    ok, bad = largest_that_fits(fits, start, 1, 512, max_trials=12)
    assert ok <= boundary < bad  # the largest success and the smallest failure straddle it, within 10%
    assert bad <= ok * 1.1 or bad - ok <= 1, (ok, bad)
    assert len(tried) == len(set(tried)) <= 12


def test_budget_search_stops_at_a_failure_that_is_not_memory():
    ok, bad = largest_that_fits(lambda x: None if x > 10 else True, 8, 1, 512)
    assert (ok, bad) == (8, None)
