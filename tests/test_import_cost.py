"""Importing the optimizers loads none of the heavy modules a step may need later: numba and Triton
are imported when a kernel first runs, ``torch._dynamo`` (and the Triton and FSDP modules it imports)
only where something compiles. Each costs seconds that a user pays at every start otherwise."""

import subprocess
import sys

HEAVY = ("torch._dynamo", "triton", "numba", "torch.distributed.fsdp")


def test_importing_the_optimizers_loads_no_compiler():
    code = ("import sys, torch\n"
            "before = set(sys.modules)\n"
            "from optim import DiskSparseAdam, DiskSparseRiemannianAdam, Gefen, step_in_backward\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules and m not in before))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout
