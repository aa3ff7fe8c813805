"""The simulated device's host link: copies that take the time a link of a given rate takes.

Note [the wind tunnel]: what decides whether offloading pays is one ratio, (bytes a block
saves / link rate) over (the block's compute time). A CPU computes a transformer block
orders of magnitude slower than a GPU, so with a link scaled down by the same factor the
CPU sees the GPU's ratio: a copy that hides under a block's compute on the GPU hides on the
CPU, and one that stalls the GPU stalls the CPU by the same share. A link has two
directions that run at once (PCIe is full duplex); copies in one direction queue behind
each other, whatever stream they were issued on. Compute waiting on a copy that has not
landed waits for it (the host is the compute stream here).

>>> link = Link("device-to-host", 1e9)
>>> first, second = link.reserve(1_000_000, now=0.0), link.reserve(1_000_000, now=0.0)
>>> (first.start, first.end, second.start, second.end)
(0.0, 0.001, 0.001, 0.002)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Link", "Transfer", "forget_lateness", "sleep_until"]


class Transfer(NamedTuple):
    """One copy on a link, in seconds of the link's clock (``time.perf_counter`` unless the
    device was given another: Note [the device's clock]): when it may start and must end."""

    start: float
    end: float
    nbytes: int


class Link:
    """One direction of the host link at ``bandwidth`` bytes per second."""

    def __init__(
        self,
        direction: str,
        bandwidth: float,
        *,
        keep: int = 64,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if bandwidth <= 0:
            raise ValueError(f"a link of {bandwidth!r} bytes per second moves nothing: expected > 0")
        self.direction = direction
        self.bandwidth = float(bandwidth)
        self.busy_until = 0.0
        self.bytes = 0  # moved so far
        self.busy_s = 0.0  # time the link was busy so far
        self.transfers: list[Transfer] = []  # the last ``keep``, oldest first (tests, stats)
        self._keep = keep
        self.clock = clock
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, *, now: float | None = None, rate: float = 1.0) -> Transfer:
        """Queue ``nbytes`` behind what the link already carries; ``rate`` scales the link's
        bandwidth for this copy (a pageable copy runs slower than a pinned one)."""
        now = self.clock() if now is None else now
        with self._lock:
            start = max(now, self.busy_until)
            end = start + nbytes / (self.bandwidth * rate)
            self.busy_until = end
            self.bytes += nbytes
            self.busy_s += end - start
            transfer = Transfer(start, end, nbytes)
            self.transfers.append(transfer)
            del self.transfers[: -self._keep]
        return transfer


_lateness = threading.local()


def sleep_until(deadline: float, clock: Callable[[], float] = time.perf_counter) -> None:
    """Block the calling thread until ``clock()`` reaches ``deadline``, or earlier by what its
    previous sleeps overslept: a sleep wakes up late by a scheduler's tick, and hundreds of
    copies a step would add those ticks up into time no link takes. So each thread's timeline
    stays within one tick of the model, not within hundreds. A clock slower than the wall's
    (Note [the device's clock]) is slept on until it gets there."""
    late = getattr(_lateness, "seconds", 0.0)
    while (left := deadline - late - clock()) > 0:
        time.sleep(left)
    _lateness.seconds = max(0.0, clock() - deadline)


# Note [the device's clock]: the simulated device times its link, its copies' ends and its
# events by one clock, ``time.perf_counter`` by default. The wind tunnel gives it a clock that
# leaves out the time the training thread was kept off the CPU by other processes
# (benchmarks/longctx/tunnel.py, `UnstolenClock`): on a busy machine the host's compute then
# takes the same time on the device's clock as on a quiet one, and so do the copies beside it,
# so step times compare as on a quiet machine (a link timed by the wall would hide a copy
# behind compute that another process had slowed down).


def forget_lateness() -> None:
    """Start the calling thread's timeline afresh: its next sleep lasts its whole time."""
    _lateness.seconds = 0.0
