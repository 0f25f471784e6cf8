"""Shared test setup: CPU only, W&B off, Triton kernels under the interpreter, every test seeded."""

import os

os.environ.setdefault("WANDB_MODE", "disabled")
# Triton reads this at import time; on a CPU-only machine the kernels run in its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


# Test shapes are small: a second torch thread only adds synchronisation, and on a shared 2-core
# machine it was measured 25x slower for the DSA trajectory tests. Benchmarks choose their own.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture
def track():
    """Keeps the optimizers a test makes and closes those with files (``close()``) at its end."""
    opts = []
    yield lambda opt: opts.append(opt) or opt
    for opt in opts:
        if hasattr(opt, "close"):
            opt.close()
