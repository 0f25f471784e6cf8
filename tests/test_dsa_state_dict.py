"""Disk Sparse Adam's state dicts: a bad one (wrong step, dtype or shape, another model's, odd
contents) is refused with an error that names it, before any state file is written; a state dict
handed to ``torch.optim.SparseAdam`` never writes the files. Round trips that continue bit for bit
are in ``tests/test_protocol.py`` and ``tests/test_dsa_checkpoint.py``.
"""

import os

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam
from tests.utils import assert_close, sparse_embedding, step_random_rows


N, DIM = 200, 8


# -- a load validates everything before it writes anything ------------------------------------------
def _files(state_dir):
    return {f: open(os.path.join(state_dir, f), "rb").read() for f in sorted(os.listdir(state_dir))}


def _two_tables(state_dir, steps=3):
    a, b = sparse_embedding(N, DIM, seed=0), sparse_embedding(N, DIM, seed=1)
    opt = DiskSparseAdam([a.weight, b.weight], lr=1e-2, state_dir=state_dir, backend="torch")
    for t in range(steps):
        opt.zero_grad()
        for e in (a, b):
            e(torch.randint(0, N, (16,), generator=torch.Generator().manual_seed(t))).sum().backward()
        opt.step()
    return opt


def _bad_step(sd, v):
    sd["state"][1]["step"] = v


def _bad_dtype(sd, v):
    sd["state"][1]["exp_avg_sq"] = sd["state"][1]["exp_avg_sq"].to(torch.int64)


def _bad_shape(sd, v):
    sd["state"][1]["exp_avg"] = sd["state"][1]["exp_avg"][:-1]


@pytest.mark.parametrize("corrupt, value, error, match", [
    pytest.param(_bad_step, -5, ValueError, "step", id="step-negative"),
    pytest.param(_bad_step, 2**70, ValueError, "step", id="step-too-large"),
    pytest.param(_bad_step, 2.5, ValueError, "step", id="step-fraction"),
    pytest.param(_bad_dtype, None, TypeError, "exp_avg_sq.*dtype", id="integer-moments"),
    pytest.param(_bad_shape, None, ValueError, "exp_avg.*shape", id="short-moments"),
])
def test_bad_state_dict_leaves_every_file_untouched(tmp_path, corrupt, value, error, match):
    src = _two_tables(tmp_path / "src", steps=5)
    sd = src.state_dict()
    corrupt(sd, value)
    opt = _two_tables(tmp_path / "dst", steps=2)
    opt.flush()
    before = _files(tmp_path / "dst")
    with pytest.raises(error, match=match):
        opt.load_state_dict(sd)
    assert _files(tmp_path / "dst") == before
    opt.close()
    src.close()


# -- a state dict handed to another optimizer never writes into the files ------------------------------
def test_sparse_adam_loaded_from_a_state_dict_never_writes_the_files(tmp_path):
    emb = sparse_embedding(N, DIM, seed=0)
    ref = sparse_embedding(N, DIM, seed=0)
    dsa = DiskSparseAdam(emb.parameters(), lr=1e-2, state_dir=tmp_path, backend="torch")
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=1e-2)
    for t in range(3):
        step_random_rows(emb, dsa, t)
        step_random_rows(ref, ref_opt, t)
    sa = torch.optim.SparseAdam(emb.parameters(), lr=1e-2)
    sa.load_state_dict(dsa.state_dict())
    at_close = {k: v.clone() if torch.is_tensor(v) else v for k, v in dsa.state_dict()["state"][0].items()}
    resumed = sparse_embedding(N, DIM)  # the weights the files are flushed with, for the resume below
    resumed.load_state_dict(emb.state_dict())
    dsa.close()  # clean at step 3
    for t in range(3, 6):  # SparseAdam goes on from the handed-over moments
        step_random_rows(emb, sa, t)
        step_random_rows(ref, ref_opt, t)
    # The moments it got were the right ones. Not bitwise: SparseAdam takes the state dict's int64
    # step tensor and then computes its bias correction in float32.
    assert_close(emb.weight, ref.weight, atol=1e-6, rtol=1e-5, name="weight")
    with DiskSparseAdam(resumed.parameters(), state_dir=tmp_path, resume=True) as again:
        got = again.state_dict()["state"][0]
        assert int(got["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[key], at_close[key]), key  # the file still holds step 3's moments


def test_odd_state_dicts_are_explained(tmp_path):
    opt = DiskSparseAdam(nn.Embedding(300, 6, sparse=True).parameters(), state_dir=tmp_path / "s")
    with pytest.raises(TypeError, match="takes a state dict"):
        opt.load_state_dict(None)
    with pytest.raises(ValueError, match="lacks 'state' and 'param_groups'"):
        opt.load_state_dict({})
    opt.close()


def test_mismatched_state_dict_is_refused(tmp_path):
    a, b = sparse_embedding(40, 6), sparse_embedding(40, 6)
    opt = DiskSparseAdam([{"params": [a.weight]}, {"params": [b.weight]}], state_dir=tmp_path / "x")
    single = DiskSparseAdam(sparse_embedding(40, 6).parameters(), state_dir=tmp_path / "y")
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict(single.state_dict())
    other = DiskSparseAdam([sparse_embedding(40, 6).weight, sparse_embedding(41, 6).weight], state_dir=tmp_path / "z")
    with pytest.raises(ValueError, match="2 parameters"):
        single.load_state_dict(other.state_dict())
    wrong_emb = sparse_embedding(41, 6)
    wrong = DiskSparseAdam(wrong_emb.parameters(), state_dir=tmp_path / "w")
    wrong_emb(torch.tensor([1, 2])).sum().backward()
    wrong.step()  # state exists after a step, as SparseAdam's
    with pytest.raises(ValueError, match="exp_avg.*shape"):
        single.load_state_dict(wrong.state_dict())
    for o in (opt, single, other, wrong):
        o.close()
