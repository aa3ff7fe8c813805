"""The runtime's lock, and the records whose handles were dropped where they could not be released.

Note [releases from the collector]: a dropped handle's record is released at once only where
this thread can take the runtime's lock and does not hold it already; otherwise it is queued,
and whoever holds the lock releases the queue on leaving it. Autograd drops a handle when
backward is done with it or its graph goes, and the cycle collector frees a graph in a cycle
(an exception's traceback) inside whatever allocation started it, one that actoff makes
holding a lock of its own (a host arena's, the NVMe store's) included. Released there, the
record would take that lock again and hang the thread, or find the state it guards half
changed. actoff takes its other locks under the runtime's, never the other way round.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actoff.tiers.record import Record

__all__ = ["RuntimeLock"]


class RuntimeLock:
    """A re-entrant lock (``with lock:``) that, on its outermost exit, releases the records
    `release_when_safe` queued.

    >>> released = []
    >>> lock = RuntimeLock(released.append)
    >>> with lock:
    ...     lock.release_when_safe("record")  # the lock is held here: queued
    ...     released
    []
    >>> released
    ['record']
    """

    def __init__(self, release: Callable[[Record], None]) -> None:
        self._lock = threading.RLock()
        self._release = release
        self._dropped: collections.deque[Record] = collections.deque()
        self._depth = threading.local()  # how deep this thread holds the lock

    # Note [pack is hot] (actoff.runtime.hooks): entered for every saved tensor's unpack and release,
    # so each method reads the thread's depth once, without calls of its own.
    def __enter__(self) -> None:
        self._lock.acquire()
        depth = self._depth
        depth.value = getattr(depth, "value", 0) + 1

    def __exit__(self, *exc: object) -> None:
        depth = self._depth
        if depth.value > 1:
            depth.value -= 1
            self._lock.release()
            return
        dropped = self._dropped
        while True:
            try:
                while dropped:
                    self._release(dropped.popleft())
            finally:
                depth.value -= 1
                self._lock.release()
            # Queued by another thread after the last look, while this one held the lock?
            if not dropped or not self._try_enter():
                return

    def _try_enter(self) -> bool:
        if not self._lock.acquire(blocking=False):
            return False
        depth = self._depth
        depth.value = getattr(depth, "value", 0) + 1
        return True

    def release_when_safe(self, record: Record) -> None:
        """Release ``record`` now if that is safe here, else when the lock is next left."""
        self._dropped.append(record)  # atomic: safe from any thread, the collector included
        if not getattr(self._depth, "value", 0) and self._try_enter():
            self.__exit__()
