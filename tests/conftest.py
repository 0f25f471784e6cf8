"""Shared test setup: CPU only, W&B off, Triton kernels under the interpreter, every test seeded."""

import os

os.environ.setdefault("WANDB_MODE", "disabled")
# Triton reads this at import time; on a CPU-only machine the kernels run in its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
