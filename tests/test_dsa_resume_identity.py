"""A resume (``resume=True``) continues a state_dir only with the weights its files were flushed
with, each table in its own file: weights of another step are refused, same-shape tables given in
another order are refused, and tables whose weights cannot be told apart (same fingerprint, no names
in the files) are refused unless the parameters are named. The resume that is allowed continues
bit for bit as ``torch.optim.SparseAdam`` run without interruption."""

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam
from optim.disk_sparse import store
from optim.disk_sparse.store import StateFileError

ROWS, DIM = 1000, 4
# Rows each table trains: none of them among the rows a fingerprint of sampled rows reads
# (evenly spaced over the table), so only the rest of the table tells the tables apart.
ROWS_A, ROWS_B = torch.tensor([1, 2, 3]), torch.tensor([4, 5])


def _zero_tables():
    """Two zero-initialised same-shape tables (as biases are)."""
    a, b = nn.Embedding(ROWS, DIM, sparse=True), nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        a.weight.zero_()
        b.weight.zero_()
    return a, b


def _steps(a, b, opt, first, last):
    """Steps first..last of a loss whose gradients differ per step and per table."""
    for t in range(first, last + 1):
        gen = torch.Generator().manual_seed(t)
        opt.zero_grad()
        loss = ((a(ROWS_A) - torch.randn(3, DIM, generator=gen)) ** 2).sum()
        loss = loss + ((b(ROWS_B) - torch.randn(2, DIM, generator=gen)) ** 2).sum()
        loss.backward()
        opt.step()


def _trained(tmp_path, steps=3, named=False):
    """Zero-initialised tables a, b trained ``steps`` steps on state_dir tmp_path/s (closed)."""
    a, b = _zero_tables()
    params = [("a.weight", a.weight), ("b.weight", b.weight)] if named else [a.weight, b.weight]
    opt = DiskSparseAdam(params, lr=0.1, state_dir=tmp_path / "s")
    _steps(a, b, opt, 1, steps)
    opt.close()
    return a, b


def test_zero_initialised_same_shape_tables_resumed_in_swapped_order_are_refused(tmp_path):
    """Zero-initialised tables agree on every row a sampled fingerprint reads; given in the other
    order without names, the resume would hand each the other's moments and steps. It is refused,
    naming both files."""
    a, b = _trained(tmp_path)
    with pytest.raises(StateFileError, match=r"parameter 0.*param0001\.dsa \(parameter 1\).*another order"):
        DiskSparseAdam([b.weight, a.weight], lr=0.1, state_dir=tmp_path / "s", resume=True)


def test_same_shape_tables_resumed_in_their_order_continue_as_sparse_adam(tmp_path):
    """3 steps, close, resume in the same order, 3 more steps: the weights equal (bit for bit)
    those of torch.optim.SparseAdam run 6 steps without interruption on the same losses."""
    a, b = _trained(tmp_path)
    ra, rb = _zero_tables()
    ref = torch.optim.SparseAdam([ra.weight, rb.weight], lr=0.1)
    _steps(ra, rb, ref, 1, 6)
    opt = DiskSparseAdam([a.weight, b.weight], lr=0.1, state_dir=tmp_path / "s", resume=True)
    assert (opt.step_count(a.weight), opt.step_count(b.weight)) == (3, 3)
    _steps(a, b, opt, 4, 6)
    opt.close()
    assert torch.equal(a.weight, ra.weight) and torch.equal(b.weight, rb.weight)
    assert not torch.equal(a.weight, b.weight)  # the tables did train apart


@pytest.mark.parametrize("order", ["same", "swapped"])
def test_tables_whose_fingerprints_agree_are_refused_without_names(tmp_path, monkeypatch, order):
    """Where the fingerprint reads sampled rows only (the whole-table hash is for tables up to a
    size, here none) two zero-initialised tables trained away from those rows have one fingerprint:
    a resume cannot tell them apart in either order and is refused, saying to name the parameters."""
    monkeypatch.setattr(store, "WHOLE_PRINT_BYTES", 0)
    a, b = _trained(tmp_path)
    params = [a.weight, b.weight] if order == "same" else [b.weight, a.weight]
    with pytest.raises(StateFileError, match=r"parameters 0 and 1 .*cannot be told apart.*named_parameters\(\)"):
        DiskSparseAdam(params, lr=0.1, state_dir=tmp_path / "s", resume=True)


def test_named_tables_whose_fingerprints_agree_resume_by_name(tmp_path, monkeypatch):
    """The same tables trained and resumed with names: the files' names tell them apart, so the
    resume continues (in the trained order; the other order is refused by name)."""
    monkeypatch.setattr(store, "WHOLE_PRINT_BYTES", 0)
    a, b = _trained(tmp_path, named=True)
    with pytest.raises(StateFileError, match="holds the state of parameter 'a.weight'"):
        DiskSparseAdam([("b.weight", b.weight), ("a.weight", a.weight)], state_dir=tmp_path / "s", resume=True)
    opt = DiskSparseAdam([("a.weight", a.weight), ("b.weight", b.weight)], lr=0.1, state_dir=tmp_path / "s",
                         resume=True)
    assert (opt.step_count(a.weight), opt.step_count(b.weight)) == (3, 3)
    opt.close()


def test_resume_with_weights_older_than_the_state_files_is_refused(tmp_path):
    """State files flushed at step 6 resumed with the weights of step 2 (an older checkpoint's):
    refused with an error naming the parameter and its file and saying what to do."""
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "s")
    for t in range(1, 7):
        opt.zero_grad()
        emb(torch.arange(t, 40 * t, t)).pow(2).sum().backward()
        opt.step()
        if t == 2:
            at_step_2 = emb.weight.detach().clone()
    opt.close()
    with torch.no_grad():
        emb.weight.copy_(at_step_2)
    with pytest.raises(StateFileError, match=r"parameter 0 \(shape \(1000, 4\)\).*param0000\.dsa.*step 6.*"
                                             r"restore the weights.*new state_dir"):
        DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "s", resume=True)


def test_a_fingerprint_of_the_first_scheme_still_checks_a_resume(tmp_path, monkeypatch):
    """A state file whose fingerprint was taken by the first scheme (16 sampled rows) is checked by
    that scheme: the weights it was flushed with resume, others are refused."""
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    monkeypatch.setattr(store, "PRINT_SCHEME", 0)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "s")
    opt.zero_grad()
    emb(torch.tensor([0, 999])).sum().backward()
    opt.step()
    opt.close()
    monkeypatch.undo()
    DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s", resume=True).close()
    with torch.no_grad():
        emb.weight[0] += 1  # row 0 is one of the 16 sampled
    with pytest.raises(StateFileError, match="param0000.dsa"):
        DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s", resume=True)
