"""The simulated device's streams: side streams whose queues worker threads run late, and the
calling thread's compute stream, whose events complete late.

Part of the simulated device (actoff.device.sim.device), whose `SimStreams` they belong to and call
back (ordering, races, holds); the order rules are described there.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from typing import TYPE_CHECKING

import torch
from torch.utils._mode_utils import no_dispatch

from .link import sleep_until
from .memory import poison

if TYPE_CHECKING:
    from .device import SimEvent, SimStreams

__all__ = ["ComputeStream", "Copy", "Gate", "SideStream"]


class Copy:
    """One queued copy: what it touches, and how far it has been ordered."""

    __slots__ = ("device_alias", "direction", "dst", "host_range", "pageable", "ran", "seq", "src", "what")

    def __init__(
        self,
        direction: str,
        dst: torch.Tensor,
        src: torch.Tensor,
        what: str,
        seq: int,
        pageable: bool = False,
    ) -> None:
        self.direction, self.what, self.seq = direction, what or "a copy", seq
        self.pageable = pageable  # its host side is pageable memory: slower, and the host waits
        # Held until the copy runs: aliases of its own, so that the race check can tell its
        # references from the caller's.
        self.dst = dst.detach()
        if direction == "device-to-host":  # Note [copy sources and the allocator]
            with no_dispatch():  # a snapshot, outside the device's memory
                self.src = src.detach().clone()
        else:
            self.src = src.detach()
        self.ran = False
        device, host = (src, dst) if direction == "device-to-host" else (dst, src)
        self.device_alias: torch.Tensor | None = device.detach()  # until ordered on the device
        self.host_range: tuple[int, int] | None = (host.data_ptr(), host.numel() * host.element_size())


class Gate:
    """Lets a stream run, or holds it until the host forces it (`SimStreams.hold`)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()


class SideStream:
    """A stream whose queue a worker thread runs, each item after a random delay."""

    def __init__(self, streams: SimStreams, seed: int) -> None:
        self.streams = streams
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.rng = random.Random(seed)
        self.seq = 0
        self.copies: list[Copy] = []
        self.thread = threading.Thread(target=self._work, name="actoff-simstream", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while True:
            kind, payload = self.items.get()
            if kind == "stop":
                return
            self.streams.copies_gate.open.wait()
            time.sleep(self.rng.uniform(0, self.streams.settings.max_delay_s))
            try:
                if kind == "wait":
                    self.streams.reach(payload, by="stream")
                elif kind == "record":
                    payload.time = self.streams.settings.clock()
                    payload.done.set()
                else:
                    links = self.streams.links
                    if links is None:
                        payload.dst.copy_(payload.src)
                    else:  # the link's time, whatever the memcpy took (Note [the wind tunnel])
                        moved = links[payload.direction].reserve(
                            payload.dst.numel() * payload.dst.element_size(),
                            rate=self.streams.settings.pageable_rate if payload.pageable else 1.0,
                        )
                        payload.dst.copy_(payload.src)
                        sleep_until(moved.end, self.streams.settings.clock)
                    with self.streams.lock:
                        payload.dst = payload.src = None  # the device alias alone stays
                        payload.ran = True
            except Exception as error:  # surfaces in the training thread
                self.streams.fail(RuntimeError(f"simulated copy failed: {error}"))

    def wait_stream(self, other: SideStream | ComputeStream) -> None:
        event = self.streams.event()
        other.record(event)
        self.wait_event(event)

    def wait_event(self, event: SimEvent) -> None:
        self.items.put(("wait", event))

    # Note [one queue order]: two training threads may queue on one stream, as on CUDA. A
    # copy's number and its place in the queue are taken together, under the device's lock, so
    # that an event recorded after a copy is numbered after it, and a host that sees the event
    # complete sees only copies that ran (taken apart, a copy numbered before another thread's
    # event could be queued after it and counted as done while still to run).
    def record(self, event: SimEvent) -> None:
        with self.streams.lock:
            event.done.clear()
            event.stream, event.seq, event.time = self, self.seq, None
            self.items.put(("record", event))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        direction = "device-to-host" if self.streams.is_host(dst) else "host-to-device"
        pageable = self.streams.is_pageable(dst if direction == "device-to-host" else src)
        with self.streams.lock:
            self.seq += 1
            entry = Copy(direction, dst, src, what, self.seq, pageable)
            poison(dst)
            self.copies.append(entry)
            self.items.put(("copy", entry))


class ComputeStream:
    """The calling thread's stream: work runs at once on the host, but its events complete
    late, and never before the events the stream waited on."""

    def __init__(self, streams: SimStreams, seed: int) -> None:
        self.streams = streams
        self.rng = random.Random(seed)
        self.lagging: queue.SimpleQueue = queue.SimpleQueue()
        self.last_due = 0.0
        self.last_time = 0.0  # of the last event completed (the worker thread's)
        self.waited: list[SimEvent] = []  # side events this stream waits on, not yet done
        self.thread = threading.Thread(target=self._complete, name="actoff-simcompute", daemon=True)
        self.thread.start()

    def _complete(self) -> None:
        while True:
            event, due, after, recorded = self.lagging.get()
            if event is None:
                return
            self.streams.compute_gate.open.wait()
            while (delay := due - self.streams.settings.clock()) > 0:
                time.sleep(delay)
            for other in after:
                other.done.wait()
            # Note [compute event times]: the stream reached the event when the host recorded it
            # (work runs at once on the host, and a wait that holds compute back holds the host
            # under a link model), never before the stream's previous event; not when this
            # thread got round to it, which the host's own work (holding the GIL) can put off
            # by a whole block: timed work between two events would seem to take no time.
            self.last_time = event.time = max(recorded, self.last_time)
            event.done.set()

    def record(self, event: SimEvent) -> None:
        with self.streams.lock:  # Note [one queue order]
            event.done.clear()
            event.stream, event.seq, event.time = self, -1, None
            # In order: an event completes after every event recorded before it.
            now = self.streams.settings.clock()
            self.last_due = max(self.last_due, now + self.rng.uniform(0, self.streams.settings.max_lag_s))
            self.waited = [other for other in self.waited if not other.done.is_set()]
            self.lagging.put((event, self.last_due, tuple(self.waited), now))

    def wait_event(self, event: SimEvent) -> None:
        """Compute waits for ``event``: in stream order, every copy before it is ordered for
        the caching allocator at once. The host blocks only when a copy to the device is still
        to land (compute, which runs on the host, is about to read it); a copy to the host
        need not have run, and the host is not told it has. Under a link model the host is the
        compute stream's clock: it waits for any copy (Note [the wind tunnel])."""
        self.streams.surface()
        if not event.done.is_set():
            if self.streams.links is not None or self.streams.h2d_pending(event):
                self.streams.reach(event, by="compute")
            else:
                with self.streams.lock:  # `record` replaces the list
                    self.waited.append(event)
        self.streams.ordered(event, by_host=False)

    def wait_stream(self, other: SideStream | ComputeStream) -> None:
        event = self.streams.event()
        other.record(event)
        self.wait_event(event)
