"""The one cache of the kernel launchers: bounded, least recently used entry evicted first.

Launchers keep host-side work between steps (launch tables, lookup tables on a device, job
tables) keyed by what they were built from. Keys that hold an ``id()`` are only meaningful while
that object lives: such an entry is stored with its ``owner`` (the object whose id the key holds),
which it keeps alive, so the address cannot be reused by another object while the entry exists, and
a lookup with another owner is a miss. Pure functions of hashable arguments use ``functools.cache``
instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable

_MISSING = object()


class BoundedCache:
    """At most ``maxsize`` entries; storing one more evicts the least recently used.

    ``get(key, owner=None)`` returns the value stored under ``key`` (``None`` on a miss, or when it
    was stored with another ``owner``: compared by identity); ``put(key, value, owner=None)``
    stores it and returns ``value``; ``get_or_build(key, build, owner=None)`` returns the stored
    value or ``build()``'s, storing it. Safe to share between threads.
    """

    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"BoundedCache: maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._entries: OrderedDict = OrderedDict()  # key -> (owner, value)
        self._lock = threading.Lock()

    def get(self, key: Hashable, owner: object = None):
        with self._lock:
            hit = self._entries.get(key, _MISSING)
            if hit is _MISSING or hit[0] is not owner:
                return None
            self._entries.move_to_end(key)
            return hit[1]

    def put(self, key: Hashable, value, owner: object = None):
        with self._lock:
            self._entries[key] = (owner, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return value

    def get_or_build(self, key: Hashable, build: Callable[[], object], owner: object = None):
        value = self.get(key, owner)
        return self.put(key, build(), owner) if value is None else value

    def clear(self):
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries
