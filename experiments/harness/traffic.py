"""What an optimizer's step must move through memory, and how fast the memory bus moves it.

    bytes_floor(n, p_bytes, g_bytes, state)   # B/param one pass over weights, gradient and state moves
    triad_gbps(threads)                        # GB/s of STREAM's triad (a = b + s*c) at that thread count

A step reads and writes its weights, reads its gradient, and reads and writes its state: at least
``2 * p_bytes + g_bytes + 2 * state / n`` bytes per parameter. That is the floor of a step that
streams each once; a step whose tensors do not fit in cache takes at least the floor over the
bandwidth, and its effective bandwidth is the floor over its time (below the triad's, it is bound by
its work per element, not by the memory bus).
"""

from __future__ import annotations

import statistics
import time

import torch

TRIAD_ELEMENTS = 1 << 26  # fp32 elements an array: 256 MiB, far beyond any last-level cache


def bytes_floor(n: int, p_bytes: float, g_bytes: float, state: int) -> float:
    """Bytes per parameter one pass over weights (read and written), gradient (read) and state (read
    and written) moves: ``p_bytes`` and ``g_bytes`` an element, ``state`` bytes over ``n`` parameters."""
    return 2 * p_bytes + g_bytes + 2 * state / n


def triad_gbps(threads: int, elements: int = TRIAD_ELEMENTS, repeats: int = 7) -> float:
    """STREAM's triad ``a = b + 1.5 c`` on fp32 arrays at ``threads`` torch threads: GB/s counted as
    STREAM counts (12 bytes an element: two reads, one write), the median of ``repeats``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        b, c = torch.rand(elements), torch.rand(elements)
        a = torch.empty(elements)
        torch.add(b, c, alpha=1.5, out=a)  # pages touched, threads started
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.add(b, c, alpha=1.5, out=a)
            times.append(time.perf_counter() - t0)
        return 12 * elements / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(before)
