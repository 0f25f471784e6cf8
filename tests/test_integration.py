"""Both optimizers inside the training frameworks users bring: Lightning, accelerate, transformers'
``Trainer`` and PyKEEN, on tiny models built here (nothing is downloaded).

Each run is held against the same run with the optimizer's reference (``torch.optim.SparseAdam``
for DiskSparseAdam, ``torch.optim.AdamW`` for Gefen reduced to AdamW) or against a plain training
loop with the same optimizer, bit for bit where the framework changes nothing in the arithmetic.
Every framework is optional: a test skips when its framework is not installed.
"""

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam, Gefen

ROWS, DIM, STEPS, BATCH = 40, 4, 6, 8
ADAMW = dict(layout="adamw")


def _indices(n=STEPS * BATCH, seed=3):
    return torch.randint(0, ROWS, (n,), generator=torch.Generator().manual_seed(seed))


class Table(nn.Module):
    """An embedding table (sparse for DiskSparseAdam) and a dense head (for Gefen)."""

    def __init__(self, sparse, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(ROWS, DIM, sparse=sparse)
        self.head = None if sparse else nn.Linear(DIM, 1)

    def forward(self, idx, labels=None):
        out = self.emb(idx)
        loss = out.pow(2).sum(-1).mean() if self.head is None else self.head(out).pow(2).mean()
        return {"loss": loss}


OPTIMIZERS = {  # name: (sparse model, ours, reference)
    "dsa": (True, lambda ps: DiskSparseAdam(ps, lr=0.05), lambda ps: torch.optim.SparseAdam(ps, lr=0.05)),
    "gefen": (False, lambda ps: Gefen(ps, lr=0.05, weight_decay=0.01, **ADAMW),
              lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.01)),
    "gefen-8bit": (False, lambda ps: Gefen(ps, layout="published", lr=0.05), None),
}


def _plain(name, steps=STEPS, epoch=STEPS):
    """The run without a framework: zero_grad, backward, step over the batches in order (an epoch
    of ``epoch`` batches, repeated)."""
    sparse, ours, _ = OPTIMIZERS[name]
    model = Table(sparse)
    opt = ours(model.parameters())
    idx = _indices()
    for t in range(steps):
        opt.zero_grad()
        b = t % epoch
        model(idx[b * BATCH:(b + 1) * BATCH])["loss"].backward()
        opt.step()
    _close_all(opt)
    return model


def _same(a, b, exact=True):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(p, q), n
        else:
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def _close_all(*opts):
    for o in opts:
        o = getattr(o, "optimizer", o)
        if hasattr(o, "close"):
            o.close()


# -- Lightning -------------------------------------------------------------------------------------
def _lightning_module(L, name, manual, side=1):
    """A LightningModule over ``Table`` with our optimizer (``side=1``) or the reference (2)."""
    sparse = OPTIMIZERS[name][0]
    make = OPTIMIZERS[name][side]

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Table(sparse)
            self.automatic_optimization = not manual

        def training_step(self, batch, _):
            loss = self.net(batch[0])["loss"]
            if not manual:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

        def configure_optimizers(self):
            return make(self.parameters())

    return Module()


def _fit(L, module, steps, tmp_path=None, ckpt_path=None, epoch=STEPS):
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(_indices()[:epoch * BATCH]), batch_size=BATCH, shuffle=False)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=tmp_path is not None,
                        default_root_dir=tmp_path)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("name", ["dsa", "gefen-8bit"])
def test_lightning_trains_as_the_plain_loop(name, manual):
    L = pytest.importorskip("lightning.pytorch")
    module = _lightning_module(L, name, manual)
    trainer = _fit(L, module, STEPS)
    _same(module.net, _plain(name))
    opt = trainer.optimizers[0]
    assert not any(torch.is_tensor(v) and v.numel() > 1 for st in opt.state.values() for v in st.values()
                   ) or name != "dsa"  # Lightning's device mover finds no DSA moments to copy
    _close_all(opt)


@pytest.mark.parametrize("name", ["dsa", "gefen"])
def test_lightning_resumes_from_its_checkpoint_as_the_reference_does(tmp_path, name):
    """Three steps, a checkpoint, a restart from it to six steps (Lightning restores the optimizer
    with load_state_dict and moves its state to the device): the same as that flow with the
    reference optimizer (Lightning's restart itself does not replay the data as a plain loop would)."""
    L = pytest.importorskip("lightning.pytorch")
    runs = []
    for side in (1, 2):
        first = _lightning_module(L, name, manual=False, side=side)
        trainer = _fit(L, first, 3, tmp_path=tmp_path / f"a{side}", epoch=3)
        ckpt = tmp_path / f"a{side}.ckpt"
        trainer.save_checkpoint(ckpt)
        _close_all(*trainer.optimizers)
        resumed = _lightning_module(L, name, manual=False, side=side)
        trainer = _fit(L, resumed, STEPS, tmp_path=tmp_path / f"b{side}", ckpt_path=str(ckpt), epoch=3)
        assert trainer.global_step == STEPS
        runs.append(resumed.net)
        _close_all(*trainer.optimizers)
    _same(runs[0], runs[1], exact=name == "dsa")


# -- accelerate ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dsa", "gefen", "gefen-8bit"])
def test_accelerate_prepare_trains_as_the_plain_loop(name):
    accelerate = pytest.importorskip("accelerate")
    sparse, ours, _ = OPTIMIZERS[name]
    model = Table(sparse)
    acc = accelerate.Accelerator(cpu=True)
    model, opt = acc.prepare(model, ours(model.parameters()))  # round-trips the state dict once
    assert not any(torch.is_tensor(v) for st in opt.optimizer.state.values() for v in st.values())
    idx = _indices()
    for t in range(STEPS):
        opt.zero_grad()
        acc.backward(model(idx[t * BATCH:(t + 1) * BATCH])["loss"])
        opt.step()
    _same(model, _plain(name))
    _close_all(opt)


# -- transformers' Trainer -------------------------------------------------------------------------
def _trainer_run(tmp_path, model, **kwargs):
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import Dataset

    class Batches(Dataset):
        def __len__(self):
            return STEPS * BATCH

        def __getitem__(self, i):
            return {"idx": _indices()[i]}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=0.05,
        weight_decay=0.01, lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Batches(), **kwargs)
    trainer.train()
    return trainer


class _Keyed(Table):
    def forward(self, idx):
        return super().forward(idx)


@pytest.mark.parametrize("name", ["gefen"])
def test_transformers_trainer_with_a_model_moved_after_the_optimizer(tmp_path, name):
    """``optimizers=(opt, None)``: the Trainer moves the model to its device after the optimizer
    exists; the run equals the same Trainer run with the reference optimizer. (Sparse gradients do
    not reach an optimizer in the Trainer: it takes their norm for its log at every step, which
    torch has no sparse kernel for, with SparseAdam as with DiskSparseAdam.)"""
    pytest.importorskip("transformers")
    sparse, ours, ref = OPTIMIZERS[name]
    runs = []
    for make in (ours, ref):
        model = _Keyed(sparse)
        trainer = _trainer_run(tmp_path / str(len(runs)), model, optimizers=(make(model.parameters()), None))
        runs.append(model)
        _close_all(trainer.optimizer)
    _same(runs[0], runs[1], exact=name == "dsa")


def test_transformers_trainer_builds_gefen_from_cls_and_kwargs(tmp_path):
    pytest.importorskip("transformers")
    runs = []
    for cls, kwargs in ((Gefen, dict(ADAMW)), (torch.optim.AdamW, {})):
        model = _Keyed(sparse=False)
        trainer = _trainer_run(tmp_path / cls.__name__, model, optimizer_cls_and_kwargs=(cls, kwargs))
        assert isinstance(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                          else trainer.optimizer, cls)
        runs.append(model)
    _same(runs[0], runs[1], exact=False)


# -- PyKEEN ----------------------------------------------------------------------------------------
def _pykeen_run(optimizer_cls, model_name):
    pykeen_models = pytest.importorskip("pykeen.models")
    from pykeen.datasets import Nations
    from pykeen.training import SLCWATrainingLoop

    dataset = Nations()
    torch.manual_seed(0)
    model = pykeen_models.model_resolver.make(model_name, triples_factory=dataset.training, embedding_dim=8,
                                              random_seed=0)
    for module in model.modules():  # PyKEEN's embeddings are dense; a sparse gradient is one flag away
        if isinstance(module, nn.Embedding):
            module.sparse = True
    loop = SLCWATrainingLoop(model=model, triples_factory=dataset.training, optimizer=optimizer_cls,
                             optimizer_kwargs=dict(lr=0.01))
    torch.manual_seed(1)
    loop.train(triples_factory=dataset.training, num_epochs=2, batch_size=256, use_tqdm=False)
    return model, loop.optimizer


@pytest.mark.parametrize("model_name", ["TransE", "DistMult"])
def test_pykeen_recreates_disk_sparse_adam_and_trains_as_sparse_adam(model_name):
    """PyKEEN's ``train()`` re-creates the optimizer from ``param_groups[0]``: DiskSparseAdam comes
    back with its options and trains as SparseAdam does."""
    ours, opt = _pykeen_run(DiskSparseAdam, model_name)
    assert isinstance(opt, DiskSparseAdam) and opt.defaults["state_format"] == "exact"
    ref, _ = _pykeen_run(torch.optim.SparseAdam, model_name)
    _same(ours, ref)
    opt.close()
