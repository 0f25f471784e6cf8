"""Parameters moved to the GPU after the optimizer was built (transformers' Trainer moves the model
then), against the reference optimizer built on the GPU. Needs CUDA: skipped without it; the GPU
check script (experiments/gpu_checks.sh) runs it. The CPU stand-ins (a model built on ``meta``) are
in tests/test_dsa_frameworks.py and tests/test_gefen_frameworks.py.
"""

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam, DiskSparseRiemannianAdam, Gefen

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _train(model, opt, loss_of, steps=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 500, (64,), generator=gen).cuda()
        opt.zero_grad()
        loss_of(model, idx).backward()
        opt.step()


def _emb_loss(emb, idx):
    return emb(idx).pow(2).sum(-1).mean()


@pytest.mark.parametrize("staging", [None, False])
def test_disk_sparse_adam_follows_a_table_moved_to_the_gpu(tmp_path, staging):
    torch.manual_seed(0)
    emb, ref = nn.Embedding(500, 16, sparse=True), nn.Embedding(500, 16, sparse=True)
    ref.load_state_dict(emb.state_dict())
    opt = DiskSparseAdam(emb.parameters(), lr=0.05, state_dir=tmp_path / "s", staging=staging)
    assert opt.backend_of(emb.weight) in ("numba", "torch")
    emb.cuda()
    ref.cuda()
    _train(emb, opt, _emb_loss)
    _train(ref, torch.optim.SparseAdam(ref.parameters(), lr=0.05), _emb_loss)
    assert opt.backend_of(emb.weight) == "triton"
    torch.testing.assert_close(emb.weight, ref.weight, atol=1e-6, rtol=1e-5)
    opt.close()


def test_the_ball_follows_a_table_moved_to_the_gpu(tmp_path):
    torch.manual_seed(0)
    emb = nn.Embedding(500, 16, sparse=True)
    with torch.no_grad():
        emb.weight.mul_(1e-2)
    opt = DiskSparseRiemannianAdam(emb.parameters(), lr=0.05, state_dir=tmp_path / "s")
    emb.cuda()
    _train(emb, opt, _emb_loss)
    assert opt.backend_of(emb.weight) == "triton" and bool(torch.isfinite(emb.weight).all())
    opt.close()


def test_gefen_follows_a_model_moved_to_the_gpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(500, 32), nn.Linear(32, 8))
    ref = nn.Sequential(nn.Embedding(500, 32), nn.Linear(32, 8))
    ref.load_state_dict(model.state_dict())
    opt = Gefen(model.parameters(), lr=1e-2, weight_decay=0.01, layout="adamw")
    model.cuda()
    ref.cuda()
    loss_of = lambda m, idx: m(idx).pow(2).mean()  # noqa: E731
    _train(model, opt, loss_of)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01), loss_of)
    assert all(opt.backend_of(p) == "triton" for p in model.parameters())
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
