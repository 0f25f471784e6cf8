"""Disk Sparse Adam under torch.distributed on CPU: row-sharded tables, DDP, DCP checkpoints, kills.

Every distributed run is a real gloo group of separate processes on 127.0.0.1
(``_dsa_dist_worker.py``): one 2-rank launch, then one 3-rank launch that reads the first one's
checkpoint and killed state directory, each under a hard timeout. The reference is
``torch.optim.SparseAdam`` on the whole table and the whole global batch in this process.

Why the sharded comparisons are not bit for bit: each rank first sums its own duplicate rows, then
the owner sums the ranks' sums (SparseAdam sums all duplicates at once in its sort order), so a
duplicated row's gradient may differ in its last bit. Adam divides by the gradient's own scale, so
after 50 steps the weights and moments stay within 1e-6. Same ranks, same order: bit for bit.
"""

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests import _dsa_dist_worker as W
from tests.utils import assert_close, run_gloo_ranks

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 60  # one launch, with room for a loaded machine
TOL = 1e-6
FIRST = ["train:37-float32", "train:37-float64", "dcp", "ddp", "steps_differ", "weight_file", "bad_input", "one_rank_eval",
         "crash"]  # crash last: a rank dies
SECOND = ["train:37-float32", "train:4-float32", "reshard:2", "dcp:4", "restart:2"]


def launch(world: int, specs: list, out_dir: Path, timeout: float = TIMEOUT_S) -> str:
    """Run the worker on ``world`` gloo ranks, killing them all after ``timeout``; returns the logs'
    tails of ranks that failed or timed out ("" if none)."""
    logs = [out_dir / f"log.{world}.rank{r}.txt" for r in range(world)]
    codes = run_gloo_ranks(world, HERE / "_dsa_dist_worker.py", [out_dir, *specs], logs, timeout)
    crashed_on_purpose = {world - 1} if specs[-1] == "crash" else set()
    bad = [r for r, c in enumerate(codes) if c != 0 and r not in crashed_on_purpose]
    return "\n".join(f"rank {r} (code {codes[r]}): {logs[r].read_text()[-3000:]}" for r in bad)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dsa_dist")
    failures = launch(2, FIRST, out)
    failures += launch(3, SECOND, out)
    yield out, failures
    if not os.environ.get("KEEP_DIST_OUT"):
        shutil.rmtree(out, ignore_errors=True)  # state files, checkpoints, logs


def result(runs, spec: str, world: int) -> list:
    """Every rank's result of ``spec`` in the ``world``-rank launch."""
    out, failures = runs
    res = []
    for r in range(world):
        path = out / f"{spec.replace(':', '-')}.w{world}.rank{r}.pt"
        if not path.exists():
            pytest.fail(f"scenario {spec} produced no result on rank {r}\n{failures}")
        res.append(torch.load(path, weights_only=False))
        if "error" in res[-1]:
            pytest.fail(f"scenario {spec} failed in the worker:\n{res[-1]['error']}")
    return res


def _whole(states: list) -> dict:
    """The ranks' local states laid end to end (rows in rank order), checking their row ranges."""
    assert [s["rows"] for s in states] == [(a, b) for a, b in zip([0] + [s["rows"][1] for s in states[:-1]],
                                                                  [s["rows"][1] for s in states])]
    assert len({s["step"] for s in states}) == 1, [s["step"] for s in states]
    return {k: torch.cat([s[k] for s in states]) for k in ("weight", "exp_avg", "exp_avg_sq")} | \
        {"step": states[0]["step"]}


def _assert_state_close(actual: dict, expected: dict, atol: float, what: str):
    assert actual["step"] == expected["step"], (what, actual["step"], expected["step"])
    for k in ("weight", "exp_avg", "exp_avg_sq"):
        assert actual[k].dtype == expected[k].dtype, (what, k, actual[k].dtype)
        assert_close(actual[k], expected[k], atol=atol, rtol=atol, name=f"{what}: {k}")


@pytest.mark.parametrize("world,spec", [
    pytest.param(2, "train:37-float32", id="2ranks-fp32"),
    pytest.param(2, "train:37-float64", id="2ranks-fp64"),
    pytest.param(3, "train:37-float32", id="3ranks-fp32"),
    pytest.param(3, "train:4-float32", id="3ranks-4rows-one-empty-shard"),
])
def test_sharded_training_equals_sparse_adam(runs, world, spec):
    """50 steps of a table sharded over the ranks (uneven shards, 70% of lookups on 4 rows, an empty
    batch on the last rank every 7th step, 2-D indices) equal SparseAdam on the whole table and the
    whole batch: weights, both moments and the step."""
    rows, dtype = int(spec.split(":")[1].split("-")[0]), getattr(torch, spec.split("-")[1])
    whole = _whole(result(runs, spec, world))
    ref = W.reference(W.STEPS, rows, dtype)
    assert whole["weight"].shape == (rows, W.DIM)
    assert not torch.equal(whole["weight"], W.full_table(rows, dtype)), "the table did not train"
    _assert_state_close(whole, ref, TOL, spec)


@pytest.mark.parametrize("world,spec", [(2, "train:37-float32"), (3, "train:37-float32"), (2, "train:37-float64")])
def test_exchanged_bytes_are_what_the_batches_need(runs, world, spec):
    """Bytes a rank sends per step, recounted from the batches: a header of 4 int64 (count, flag,
    table, kind) to each other rank in the forward and in the backward, 8 B per unique id it needs
    from another owner, and one row (dim values) per such id in the backward and per id another
    rank asks it for in the forward."""
    itemsize = torch.empty((), dtype=getattr(torch, spec.split("-")[1])).element_size()
    ranks = result(runs, spec, world)
    for step in range(W.STEPS):
        need = [torch.unique(W.rank_piece(step, r, world)[0]) for r in range(world)]
        owner = [torch.div(u, -(-W.ROWS // world), rounding_mode="floor") for u in need]
        for r, res in enumerate(ranks):
            remote = int((owner[r] != r).sum())
            asked = sum(int((owner[q] == r).sum()) for q in range(world) if q != r)
            expected = 2 * 32 * (world - 1) + 8 * remote + (remote + asked) * W.DIM * itemsize
            assert int(res["sent"][step]) == expected, (step, r, int(res["sent"][step]), expected)


@pytest.mark.parametrize("world,spec,rows", [pytest.param(2, "dcp", W.ROWS, id="2ranks"),
                                             pytest.param(3, "dcp:4", 4, id="3ranks-one-empty-shard")])
def test_dcp_round_trip_continues_identically(runs, world, spec, rows):
    """Save at step 20, train 10 more; fresh tables (other weights) and optimizers (other lr,
    restored from the checkpoint's param groups) load it and train the same 10 steps: bit for bit,
    and the loaded state is the saved one. Also with a rank that owns no rows."""
    ranks = result(runs, spec, world)
    for rank in ranks:
        _assert_state_close(rank["loaded"], rank["saved"], 0.0, "loaded")
        _assert_state_close(rank["resumed"], rank["uninterrupted"], 0.0, "resumed")
    assert ranks[-1]["saved"]["rows"][0] == ranks[-1]["saved"]["rows"][1] or rows == W.ROWS
    _assert_state_close(_whole([r["uninterrupted"] for r in ranks]), W.reference(W.K1 + W.K2, rows), TOL,
                        "vs SparseAdam")


def test_weights_in_files_resume_with_the_state(runs):
    """Shards kept in weight files: closed after 20 steps, reopened (weights from the files, state
    with resume=True), 10 more steps: bit for bit the uninterrupted run's. A file of another dtype
    gets another name; one of another size is refused."""
    uninterrupted = result(runs, "dcp", 2)
    for rank, (res, ref) in enumerate(zip(result(runs, "weight_file", 2), uninterrupted)):
        assert res["file"].endswith(f"rank{rank}-of-2.float32.weight"), res["file"]
        assert torch.equal(res["reopened"], res["saved"]) and torch.equal(res["saved"], ref["saved"]["weight"])
        _assert_state_close(res["final"], ref["uninterrupted"], 0.0, "resumed from weight files")
        assert "weight file" in res["message"] and "bytes" in res["message"], res["message"]


def test_ranks_at_different_steps_are_refused_together(runs):
    """Both ranks' files are clean, but rank 0's stand one step further: resume=True refuses on both."""
    for res in result(runs, "steps_differ", 2):
        m = res["message"]
        assert m.startswith("StateFileError") and "different steps {0: [3], 1: [2]}" in m, m


def test_dcp_two_ranks_load_onto_three(runs):
    """The 2-rank checkpoint loaded on 3 ranks (other row ranges) holds the saved table and moments
    exactly; 10 more steps on 3 ranks equal the uninterrupted 2-rank run (up to the order of the
    duplicate sums, see the module docstring) and SparseAdam."""
    saved = _whole([r["saved"] for r in result(runs, "dcp", 2)])
    uninterrupted = _whole([r["uninterrupted"] for r in result(runs, "dcp", 2)])
    three = result(runs, "reshard:2", 3)
    assert [r["loaded"]["rows"] for r in three] == [(0, 13), (13, 26), (26, 37)]
    _assert_state_close(_whole([r["loaded"] for r in three]), saved, 0.0, "loaded on 3 ranks")
    resumed = _whole([r["resumed"] for r in three])
    _assert_state_close(resumed, uninterrupted, TOL, "resumed on 3 ranks")
    _assert_state_close(resumed, W.reference(W.K1 + W.K2), TOL, "resumed vs SparseAdam")


def test_killed_rank_leaves_a_directory_refused_on_restart(runs):
    """Rank 1 was SIGKILLed after a step (its state file dirty), rank 0 closed cleanly. Reopening the
    directory with resume=True refuses on both ranks: rank 1 because its file is dirty, rank 0
    because rank 1 was refused."""
    messages = [r["message"] for r in result(runs, "restart:2", 3)[:2]]
    for m in messages:
        assert m.startswith("StateFileError") and "rank 1: StateFileError" in m and "dirty" in m, m
        assert "rank 0" not in m, m  # rank 0's own files are clean: only rank 1 is named


def test_bad_indices_raise_on_every_rank(runs):
    """Indices out of range or of a float dtype on the last rank raise on every rank (no rank left
    in a collective); the group then looks rows up correctly; a table of another dim on one rank is
    refused on every rank at construction."""
    for rank, res in enumerate(result(runs, "bad_input", 2)):
        assert res["messages"]["range"].startswith("IndexError") and "rank 1 got indices outside [0, 37)" \
            in res["messages"]["range"], res["messages"]
        assert res["messages"]["negative"].startswith("IndexError"), res["messages"]
        assert res["messages"]["dtype"].startswith("TypeError") and "non-integer" in res["messages"]["dtype"]
        assert "ranks build different tables" in res["messages"]["dim"], res["messages"]  # on every rank
        table = res["table"]
        assert torch.equal(res["rows"], table[torch.tensor([[36, 0], [0, 3]])])


def test_a_lookup_on_one_rank_alone_raises_on_every_rank_naming_the_calls(runs):
    """Rank 0 alone looks rows up between training steps (an evaluation): under no_grad its lookup
    meets rank 1's training lookup, with gradients on its next training lookup meets rank 1's
    backward; two tables looked up in another order on each rank meet each other. Each raises a
    RuntimeError on both ranks naming both calls (it aborted rank 0 inside gloo); afterwards a
    lookup of every rank gives the table's rows and a training step runs."""
    ranks = result(runs, "one_rank_eval", 2)
    for res in ranks:
        m = res["messages"]
        assert "rank 0 in a lookup without gradient of table" in m["no_grad"], m["no_grad"]
        assert "rank 1 in a lookup with gradient of table" in m["no_grad"], m["no_grad"]
        assert "rank 0 in a lookup with gradient" in m["grad"] and "rank 1 in a backward" in m["grad"], m["grad"]
        assert "under torch.no_grad()" in m["grad"], m["grad"]
        tables = re.findall(r"rank (\d) in a lookup without gradient of table (\d+)", m["order"])
        assert len(tables) == 2 and tables[0][1] != tables[1][1], m["order"]
    at_lookup = torch.cat([r["at_lookup"] for r in ranks])
    assert torch.equal(ranks[0]["looked_up"], at_lookup[torch.tensor([[36, 0], [0, 3]])])
    assert ranks[1]["looked_up"].shape == (0, W.DIM)
    assert [r["step"] for r in ranks] == [2, 2]  # the refused steps were not taken, the last one was
    assert not torch.equal(torch.cat([r["weight"] for r in ranks]), at_lookup)


def test_ddp_with_disk_sparse_adam_equals_sparse_adam(runs):
    """nn.Embedding(sparse=True) under DDP (gradients averaged over 2 ranks), DiskSparseAdam on each
    rank: every rank holds the same table, equal to SparseAdam on the whole batch with the loss
    halved; rank 0's checkpoint (opt.state_dict()) loaded on every rank continues bit for bit."""
    ranks = result(runs, "ddp", 2)
    ref = W.reference(W.STEPS, scale=0.5)
    for r in ranks:
        assert torch.equal(r["final"]["weight"], ranks[0]["final"]["weight"])
        _assert_state_close(r["final"], ref, TOL, "DDP")
        assert torch.equal(r["resumed"], r["final"]["weight"])


@pytest.mark.parametrize("shape", [pytest.param((0, 6), id="2d"), pytest.param((0,), id="1d")])
def test_table_without_rows_round_trips_state_dicts(tmp_path, shape):
    """The shard of a rank that owns no rows: its state dict (and SparseAdam's of such a table)
    loads, and steps on empty gradients keep counting as SparseAdam's do."""
    from optim import DiskSparseAdam

    def empty_grad(p):
        values = torch.zeros(0, *p.shape[1:])
        return torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), values, p.shape, check_invariants=True)

    p, q = torch.nn.Parameter(torch.zeros(shape)), torch.nn.Parameter(torch.zeros(shape))
    ref = torch.optim.SparseAdam([q])
    with DiskSparseAdam([p], state_dir=tmp_path / "a") as opt:
        for _ in range(3):
            p.grad, q.grad = empty_grad(p), empty_grad(q)
            opt.step()
            ref.step()
        saved = opt.state_dict()
        for sd in (saved, ref.state_dict()):
            with DiskSparseAdam([torch.nn.Parameter(torch.zeros(shape))], state_dir=tmp_path / str(id(sd))) as fresh:
                fresh.load_state_dict(sd)
                assert int(fresh.state_dict()["state"][0]["step"]) == 3
                assert fresh.state_dict()["state"][0]["exp_avg"].shape == shape
