"""One line on stderr when a step waits on numba compiling its kernels for more than two seconds.

The first step of a process compiles the CPU kernels it uses (numba; cached on disk, so a later
process loads them in well under a second). ``compile_notice(owner)`` is put around a step: while
it runs, a listener of numba's compile events (``numba.core.event``, installed for that block only,
not for the process) starts a timer at the first compilation; if compiling still goes on after
``after`` seconds, the line is printed, once per process and owner. Nothing is imported or
listened to for a step that uses no numba kernel, nor after a step of the owner that compiled
nothing (the listener costs tens of microseconds a step).
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

AFTER_S = 2.0
_said: set = set()  # owners that have printed their line in this process
_settled: set = set()  # owners that have run a step that compiled nothing


@contextmanager
def compile_notice(owner: str, uses_numba, after: float = AFTER_S):
    """Run the block; say on stderr (once per process and ``owner``) when it spends more than
    ``after`` seconds compiling numba kernels. ``uses_numba()``: True where the block may launch one
    (asked only while the owner has not settled)."""
    if owner in _said or owner in _settled or not uses_numba():
        yield
        return
    from numba.core import event

    listener = _make_listener(event.Listener, owner, after)
    try:
        with event.install_listener("numba:compile", listener):
            yield
    finally:
        listener.stop()
    if listener.started is None:
        _settled.add(owner)


def _make_listener(base, owner: str, after: float):
    class Notice(base):
        """Times the outermost compilation; the timer prints the line."""

        def __init__(self):
            self.depth = 0
            self.timer = None
            self.started = None

        def on_start(self, event):
            self.depth += 1
            if self.depth == 1 and owner not in _said and (self.timer is None or not self.timer.is_alive()):
                self.started = self.started or time.perf_counter()
                self.timer = threading.Timer(after, self.say)
                self.timer.daemon = True
                self.timer.start()

        def on_end(self, event):
            self.depth -= 1

        def say(self):
            if self.depth > 0 and owner not in _said:
                _said.add(owner)
                print(f"{owner}: compiling the numba CPU kernels for this first step "
                      f"({time.perf_counter() - self.started:.0f} s so far; cached on disk, so later "
                      "processes start at once)", file=sys.stderr, flush=True)

        def stop(self):
            if self.timer is not None:
                self.timer.cancel()

    return Notice()
