"""The record layout of Disk Sparse Adam's compact state format (``state_format="compact"``).

A row of ``D`` values keeps, in one record of bytes (the state file's dtype is ``uint8``)::

    bytes 0..3     s: float32, the scale of the row's first-moment codes (max |m| of the row)
    bytes 4..7     v: float32, the row's one second moment (row-wise v)
    bytes 8..8+D   q: int8 codes of the first moment, m = q * (s / 127)
    then           zero padding to a multiple of 4 bytes (so that every record's s and v are aligned)

which is ``D + 8`` to ``D + 11`` bytes a row, against ``8 D`` for the exact format's float32 ``[m | v]``.
The update rules are ``reference.compact_adam_rows`` and ``reference.compact_riemannian_adam_rows``.
The code is linear (symmetric int8, one scale per row): ``experiments/dsa_out_of_core.py`` compares it
with a learned codebook.
"""

from __future__ import annotations

import torch

HEAD_BYTES = 8  # s and v


def record_bytes(cols: int) -> int:
    """Bytes of a row's compact record."""
    return HEAD_BYTES + -(-cols // 4) * 4


def views(records: torch.Tensor, cols: int):
    """``(s, v, q)`` views of ``(n, record_bytes(cols))`` uint8 records: float32 ``(n, 1)``, float32
    ``(n, 1)``, int8 ``(n, cols)``; writing them writes the records."""
    if records.dtype != torch.uint8 or records.shape[-1] != record_bytes(cols):
        raise ValueError(f"compact records must be uint8 of width {record_bytes(cols)}, got "
                         f"{records.dtype} of width {records.shape[-1]}")
    s = records[:, 0:4].view(torch.float32)
    v = records[:, 4:8].view(torch.float32)
    q = records[:, HEAD_BYTES:HEAD_BYTES + cols].view(torch.int8)
    return s, v, q
