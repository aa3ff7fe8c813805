"""Records coming back in backward, one saved tensor at a time, in backward's order, within a
window: of runs (``prefetch_depth``) or of bytes (``fetch_window``).

Note [fetch per saved tensor]: backward needs a block's saved tensors one autograd node at a
time, so they come back one record at a time, in the order backward unpacks them: the order the
last step of the same shape unpacked (each backward records it), else the forward's reversed.
When autograd unpacks a record, the records after it in that order start coming back, as far as
the window reaches:
- a window of runs (``prefetch_depth``, the default): every record of the run being unpacked and
  of the ``depth`` runs before it, up to a run whose placement is not fetched ahead (``chunked``);
- a window of bytes (``fetch_window``): records fetched and not yet let go (coming back, or back
  and waiting for their node) hold at most that many bytes; ``0`` fetches each at its own unpack,
  as PyTorch's ``save_on_cpu`` does, with one node's saves on the device at a time.
A record autograd has consumed goes as its node lets go of it (its release); one a retained graph
keeps is evicted, least recently unpacked first, when the window needs its room (a second
backward fetches it again). Records still being copied out are served from the device (Note
[forward what is still on the device]); records kept on the device need nothing.

The window in bytes is what makes actoff's floor one node's saves rather than a block's: with
``0`` it holds what ``save_on_cpu`` holds, and with a few MiB the copies back hide behind
backward's compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from actoff.tiers.base import NoStagingRoom
from actoff.tiers.record import Record, State, serve

if TYPE_CHECKING:
    import torch

    from .step import ScopeRun, Step

__all__ = ["FetchQueue"]


class FetchQueue:
    """A step's records in backward's order, and those fetched and not let go yet."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.order: list[Record] | None = None  # made at the step's first unpack
        self.cursor = 0  # records before it are fetched, served from the device, or gone
        self.fetched: dict[Record, bool] = {}  # fetched and not let go -> unpacked since
        self.held = 0  # their bytes
        self.peak = 0  # the most bytes held at once (statistics)
        self.trace: list[tuple[int, int]] = []  # (run, record) in the order unpacked, first time each
        self.entered: set[int] = set()  # runs whose records served from the device were `expect`ed

    # ------------------------------------------------------------------ order
    def _make_order(self, learned: list[tuple[int, int]] | None) -> list[Record]:
        """Every record a tier fetches, in the learned order where it fits this step, then the
        forward's reversed for the rest."""
        records: dict[tuple[int, int], Record] = {}
        for run in reversed(self.step.runs):
            for record in reversed(run.all_records()):
                if record.tier is not None and record.tier.fetches:
                    records[(run.index, record.index)] = record
        order = [records.pop(key) for key in learned or () if key in records]
        return order + list(records.values())

    # ------------------------------------------------------------------ backward
    @property
    def busy(self) -> bool:
        """Whether records are still to be fetched this backward (a kept run's unpack moves them on)."""
        return self.order is None or self.cursor < len(self.order)

    def signature(self) -> tuple:
        """The step's shape, for the order learned from another step: each run's block and records."""
        return tuple((run.name, len(run.all_records())) for run in self.step.runs)

    def unpacking(self, run: ScopeRun, record: Record | None, orders: Mapping[tuple, list]) -> None:
        """Autograd unpacks ``record`` of ``run`` (None: a tensor kept as is): fetch what the window
        reaches (the runtime's lock held); ``orders`` are the unpack orders of earlier steps."""
        if self.order is None:
            self.order = self._make_order(orders.get(self.signature()))
        run.fetch_issued = True  # (a run kept as is has nothing to fetch)
        if record is not None and (not self.trace or self.trace[-1] != (run.index, record.index)):
            self.trace.append((run.index, record.index))
        self._poll()
        depth, window = run.fetch_limits()
        order = self.order
        while self.cursor < len(order):
            candidate = order[self.cursor]
            if window is None and candidate.run.index < run.index - depth:
                break  # past the window of runs
            if window is None and candidate.run is not run and not candidate.run.placement.fetches_ahead:
                break  # its own first unpack fetches it (Note [no fetch ahead of chunks]), and those before it
            if candidate.run.index not in self.entered:
                self._enter(candidate.run)
            if not self._needs_fetch(candidate):
                self.cursor += 1
                continue
            nbytes = candidate.geometry.nbytes
            if (
                window is not None
                and self.held
                and self.held + nbytes > window
                and not self._evict(nbytes, window)
            ):
                break
            try:
                candidate.tier.fetch(candidate)
            except NoStagingRoom:  # Note [staging room for reads]
                if self.make_room():
                    continue  # the fetches in flight landed: their staging is free again
                if candidate is record:
                    raise
                break  # fetched at its own unpack, or once room is back
            self._fetched(candidate)
            self.cursor += 1

    def serve(self, record: Record) -> torch.Tensor:
        """``record``'s device tensor (`actoff.tiers.record.serve`), once the fetches in flight
        land where its own has no staging room (Note [staging room for reads])."""
        try:
            return serve(record)
        except NoStagingRoom:
            if not self.make_room():
                raise
            return serve(record)

    def make_room(self) -> bool:
        """(Note [staging room for reads]) Land the fetches in flight that hold host staging
        memory, which then goes back; whether any did."""
        landed = False
        for fetched in self.fetched:
            if fetched.state is State.FETCHING:
                landed = fetched.tier.land(fetched) or landed
        return landed

    def _enter(self, run: ScopeRun) -> None:
        """The window reaches ``run``: the device arena hears of its records served from the device
        before any of its fetches, so it sizes the run's buffers to what is fetched (Note [skipped
        requests], actoff.memory.device_arena)."""
        self.entered.add(run.index)
        run.fetch_issued = True  # its records are fetched or served from here on
        for record in run.all_records():
            if record.state is State.OFFLOADING:
                record.tier.settle(record)  # a staged write that has ended since: finish it
            if record.state is State.OFFLOADING and record.device_tensor is not None:
                run.expect_device_buffer(record)
                if record.tier is not None and record.tier.fetches:
                    self._fetched(record)  # served from the device: in the window till let go

    @staticmethod
    def _needs_fetch(record: Record) -> bool:
        """Whether ``record`` is to be fetched: not if it is served from the device (still being
        copied out, or its tensor alive elsewhere) or back already.

        Note [forward what is still on the device]: a record whose copy out is still under way
        when the window reaches it (the last runs placed, or a streamed record whose copy has not
        landed) keeps its device tensor and is served from it: finishing the copy only to copy it
        back would cost a round trip. It also keeps the device arena's requests the same from
        step to step, whenever the copies end.
        """
        return record.state is State.OFFLOADED and record.live_source() is None

    def _fetched(self, record: Record) -> None:
        self.fetched[record] = False
        self.held += record.geometry.nbytes
        self.peak = max(self.peak, self.held)

    def consumed(self, record: Record) -> None:
        """Autograd has ``record``'s tensor: its bytes stay in the window until it lets go of it
        (one that came back only now, at its own unpack, counts from now); once every save of it
        has unpacked it, only a retained graph keeps it, and it may be evicted."""
        record.unpacks += 1
        if record not in self.fetched:
            if record.state is not State.READY or record.tier is None or not record.tier.fetches:
                return
            self._fetched(record)
        self.fetched[record] = record.unpacks >= record.uses

    def _evict(self, nbytes: int, window: int) -> bool:
        """Room for ``nbytes`` in the window from records every save of which has unpacked them
        and still back (a retained graph's), oldest first; whether there is room now."""
        for record in [record for record, unpacked in self.fetched.items() if unpacked]:
            if record.state is State.READY:
                record.tier.evict(record)
                self.let_go(record)
            if self.held + nbytes <= window:
                return True
        return False

    def let_go(self, record: Record) -> None:
        """``record`` was released or evicted: its bytes leave the window."""
        if self.fetched.pop(record, None) is not None:
            self.held -= record.geometry.nbytes

    def _poll(self) -> None:
        """Move the fetches in flight on without waiting (an NVMe read that landed starts its copy)."""
        for record in self.fetched:
            if record.state is State.FETCHING:
                record.tier.poll(record)

    def ended(self) -> list[tuple[int, int]]:
        """Backward ended: what it unpacked, in order; a retained graph's next backward starts over."""
        self.order, self.cursor = None, 0
        self.entered.clear()
        self.fetched.clear()
        self.held = 0
        trace, self.trace = self.trace, []
        return trace
