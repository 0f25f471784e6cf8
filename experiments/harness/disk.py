"""The disk under a file: its 4 KiB random-read rate, and dropping the file's pages from the cache.

    drop_cache(path)                                    # the next reads of path go to the disk
    random_read_rate(path, 4000, seed=0, threads=32)    # reads/s at queue depth 32

A cold optimizer step reads one page per touched state record that is not cached, so this rate,
measured on the same file in the same run, bounds what a cold step can reach.
"""

from __future__ import annotations

import os
import random
import threading
import time

PAGE = 4096


def drop_cache(path) -> None:
    """Drop ``path``'s pages from the page cache (``posix_fadvise`` DONTNEED; dirty pages stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def random_offsets(size: int, n: int, seed: int) -> list[int]:
    """``n`` page-aligned offsets drawn uniformly from the pages of a file of ``size`` bytes after its
    first page (a header, read by every step and so cached)."""
    pages = size // PAGE
    if pages < 2:
        raise ValueError(f"a random-read measure needs a file of two pages or more ({PAGE} bytes each); "
                         f"this one has {size} bytes")
    rng = random.Random(seed)
    return [rng.randrange(1, pages) * PAGE for _ in range(n)]


def random_read_rate(path, n_reads: int, seed: int, threads: int = 1) -> float:
    """4 KiB ``pread``s per second at random page offsets of ``path``, its cache dropped first,
    ``threads`` of them in flight (the queue depth)."""
    drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets = random_offsets(os.fstat(fd).st_size, n_reads, seed)

        def work(part):
            for off in part:
                os.pread(fd, PAGE, off)

        t = time.perf_counter()
        if threads == 1:
            work(offsets)
        else:
            pool = [threading.Thread(target=work, args=(offsets[k::threads],)) for k in range(threads)]
            for th in pool:
                th.start()
            for th in pool:
                th.join()
        return n_reads / (time.perf_counter() - t)
    finally:
        os.close(fd)
