"""``optim._compiling.compile_notice``: one line on stderr when a block waits on numba compiling.

Each case runs in a child process (numba's listeners and the once-per-process record are process
state) with a fresh numba cache, around a function numba has not compiled in that process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba")

CHILD = textwrap.dedent("""
    import sys
    import numba
    from optim._compiling import compile_notice

    def fresh(k):
        @numba.njit
        def f(x):
            s = 0.0
            for i in range(x.shape[0]):
                s += x[i] * k
            return s
        return f

    import numpy as np
    x = np.ones(4)
    after = float(sys.argv[1])
    for k in range(int(sys.argv[2])):  # each block compiles a new function
        with compile_notice("Owner", lambda: sys.argv[3] == "numba", after=after):
            fresh(k)(x)
    print("done")
""")


def _run(after, blocks, uses, tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(after), str(blocks), uses], capture_output=True,
                         text=True, timeout=300, env={"NUMBA_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin",
                                                     "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
    return [line for line in out.stderr.splitlines() if line.startswith("Owner:")]


def test_a_block_that_compiles_past_the_limit_says_so_once_per_process(tmp_path):
    lines = _run(0.0, 3, "numba", tmp_path)
    assert len(lines) == 1, lines
    assert "compiling the numba CPU kernels" in lines[0] and "cached on disk" in lines[0]


def test_a_block_that_compiles_within_the_limit_says_nothing(tmp_path):
    assert _run(60.0, 2, "numba", tmp_path) == []


def test_a_block_that_uses_no_numba_kernel_listens_to_nothing(tmp_path):
    assert _run(0.0, 2, "torch", tmp_path) == []
