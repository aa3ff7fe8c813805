"""The runtime's lock, its per-thread state, and the records released on leaving it.

Note [releases from the collector]: autograd drops a handle when backward is done with it, or
when its graph goes; the cycle collector frees a graph in a cycle (an exception's traceback)
inside whatever allocation started it, one that actoff makes holding a lock of its own (a host
arena's, the NVMe store's, the simulated device's) included. Released there, the record would
take that lock again and hang the thread, or find the state it guards half changed. So a
dropped handle is released at once only where this thread can take the runtime's lock and does
not hold it already; otherwise it is queued, and whoever holds the lock releases it on leaving
(every actoff lock is taken under it).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

__all__ = ["RuntimeLock", "ThreadState"]


class ThreadState(threading.local):
    """Per thread: the offload scopes it is inside, ``no_offload`` depth, the lock's depth."""

    def __init__(self) -> None:
        self.stack: list[Any] = []  # actoff._step.ScopeRun
        self.disabled = 0
        self.locked = 0  # depth of the runtime's lock in this thread


class RuntimeLock:
    """The runtime's re-entrant lock; on leaving it, the records whose handles were dropped
    while it was busy are released with ``release(record)``."""

    def __init__(self, thread: ThreadState, release: Any) -> None:
        self._lock = threading.RLock()
        self._thread = thread
        self._release = release
        self._dropped: collections.deque = collections.deque()  # records (actoff._record)

    def __enter__(self) -> None:
        self._lock.acquire()
        self._thread.locked += 1

    def __exit__(self, *exc: object) -> None:
        if self._thread.locked > 1:
            self._thread.locked -= 1
            self._lock.release()
            return
        while True:
            try:
                while self._dropped:
                    self._release(self._dropped.popleft())
            finally:
                self._thread.locked -= 1
                self._lock.release()
            # Queued by another thread after the last look, while this one held the lock?
            if not self._dropped or not self.try_acquire():
                return

    def try_acquire(self) -> bool:
        if not self._lock.acquire(blocking=False):
            return False
        self._thread.locked += 1
        return True

    def drop(self, record: Any) -> None:
        """A handle to ``record`` was dropped: release it now or, if that is not safe here,
        when the lock is next left."""
        self._dropped.append(record)  # atomic: safe from any thread, the collector included
        if not self._thread.locked and self.try_acquire():
            self.__exit__()
