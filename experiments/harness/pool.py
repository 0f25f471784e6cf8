"""Single-threaded training runs, several at a time, each in its own process.

Every run the experiments submit is seeded and deterministic, so results do not depend on how many
run at once; ``jobs=1`` runs each one in this process when its result is asked for.
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing

import torch


class _Inline:
    """A future of a call made when its result is first asked for."""

    def __init__(self, fn, args):
        self._call, self._done, self._value, self._callbacks = (fn, args), False, None, []

    def result(self):
        if not self._done:
            fn, args = self._call
            self._value, self._done = fn(*args), True
            for callback in self._callbacks:
                callback(self)
        return self._value

    def exception(self):
        return None  # a call that raised raises from ``result``; its callbacks never run

    def add_done_callback(self, fn):
        """``fn(self)`` once the call has returned (as ``concurrent.futures.Future``'s)."""
        self._callbacks.append(fn)


class Done:
    """A future already resolved to ``value`` (a run finished by an earlier process)."""

    def __init__(self, value):
        self._value = value

    def result(self):
        return self._value


class RunPool:
    """``submit(fn, *args)`` gives a future; ``jobs`` > 1 runs the calls in spawned processes with one
    torch thread each (``fn`` must be a module-level function). Use as a context manager: leaving it
    cancels what has not started."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self._pool = (futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=torch.set_num_threads, initargs=(1,))
                      if jobs > 1 else None)

    def submit(self, fn, *args):
        return self._pool.submit(fn, *args) if self._pool else _Inline(fn, args)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._pool:
            self._pool.shutdown(cancel_futures=True)
