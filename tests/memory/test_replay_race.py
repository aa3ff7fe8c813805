"""The sanitizer's race under the replay allocator, settled on the simulated device.

On the H100, ``TORCH_CUDA_SANITIZER=1`` reported that a kernel on the compute stream wrote to
an address a device-to-host copy of the cpu tier had read, with ``ACTOFF_ALLOCATOR=replay``
(benchmarks/results/h100-2026-11-23/sanitizer-call1.log). The sanitizer learns of frees from
the caching allocator only, and takes no host observation of a copy (an event's ``query``)
for an ordering, so it cannot tell this apart from a real race: the replay allocator handing
a range to new work while a copy still reads it.

Here every storage of a training step on the simulated device gets its address from the
replay allocator's own core (csrc/replay_allocator.h, the host build: it records the first
step, plans it, replays the next at planned offsets, and reuses a freed range on its stream
at once). Each copy between a device storage and the host is followed until the simulated
device orders it for the compute stream (a compute-stream wait on it, or the host seeing it
done). An address handed out over the device side of a copy not yet so ordered is the race
the sanitizer suspected. Under the cpu policy none occurs, copies held back or running late;
with the copy source dropped early (the bug the check must catch) it occurs at once.
"""

import threading

import pytest
import torch
from _helpers import HostEngine, make_model, train
from torch.utils._mode_utils import no_dispatch

import actoff
from actoff.device.sim.memory import BLOCK, DeviceMemory
from actoff.device.sim.streams import SideStream
from actoff.memory.replay_steps import Replay
from actoff.reference import Block
from actoff.testing import simulated_device
from actoff.tiers.cpu import CpuTier

pytestmark = [
    pytest.mark.no_sim_device,  # each test builds the simulated device it needs
    pytest.mark.skipif(
        not actoff.HAS_EXTENSION, reason="the replay allocator's core is in the C++ extension"
    ),
]


class ReplayShadow:
    """The replay allocator's addresses for the simulated device's storages, and the copies'
    device ranges until the device orders them; `races` lists every address handed out over
    a range a copy not yet ordered reads or writes."""

    def __init__(self, device, monkeypatch) -> None:
        self.engine = HostEngine()
        self.replay = Replay(self.engine)
        self.lock = threading.RLock()  # a storage may die on any thread, or inside an allocation
        # A live storage's key -> its replay address, and the CPU range it covers: an arena
        # tenant (Note [device tenants]) has a storage of its own inside a tracked buffer's.
        self.addresses: dict[int, tuple[int, int]] = {}
        self.cpu_ranges: dict[int, tuple[int, int]] = {}
        self.pending: dict[tuple[int, int], tuple[int, int, str]] = {}  # (stream, seq) -> range, what
        self.races: list[str] = []
        self.copies = self.untracked = 0
        self._watch_memory(device.memory, monkeypatch)
        self._watch_copies(device, monkeypatch)

    # ------------------------------------------------------------ storages: the allocator's side
    def _watch_memory(self, memory: DeviceMemory, monkeypatch) -> None:
        track, free = memory._track, memory._free

        def tracked(storage: torch.UntypedStorage) -> None:
            track(storage)  # registers `memory._free` (the wrapper below) as the finalizer
            size = max(-(-storage.nbytes() // BLOCK) * BLOCK, BLOCK)
            with self.lock:
                address = self.engine.core.allocate(size)
                self.addresses[id(storage)] = (address, size)
                self.cpu_ranges[id(storage)] = (storage.data_ptr(), storage.nbytes())
                for start, length, what in self.pending.values():
                    if start < address + size and address < start + length:
                        self.races.append(
                            f"{what}: its device range [{start:#x}, +{length}) was handed out again"
                        )

        def freed(key: int) -> None:
            free(key)
            with self.lock:
                found = self.addresses.pop(key, None)
                if found is not None:
                    del self.cpu_ranges[key]
                    self.engine.core.deallocate(found[0])

        monkeypatch.setattr(memory, "_track", tracked)
        monkeypatch.setattr(memory, "_free", freed)

    # ------------------------------------------------------------ copies: the device's side
    def _watch_copies(self, device, monkeypatch) -> None:
        queue, order = SideStream.copy, device.ordered

        def copy(stream: SideStream, dst, src, what: str) -> None:
            queue(stream, dst, src, what)
            with device.lock:
                entry = stream.copies[-1]
                on_device = src if entry.direction == "device-to-host" else dst
                # The copy no longer holds its device tensor: its owner alone decides when the
                # storage dies, and the allocator then hands the range out again.
                entry.device_alias = None
            pointer = on_device.data_ptr()
            with self.lock:
                key = next(
                    (k for k, (low, size) in self.cpu_ranges.items() if low <= pointer < low + size), None
                )
                if key is None:
                    self.untracked += 1
                    return
                self.copies += 1
                start = self.addresses[key][0] + (pointer - self.cpu_ranges[key][0])
                length = on_device.numel() * on_device.element_size()
                self.pending[(id(stream), entry.seq)] = (start, length, f"{what} ({entry.direction})")

        def ordered(event, *, by_host: bool) -> None:
            order(event, by_host=by_host)
            with self.lock:
                for stream_id, seq in list(self.pending):
                    if stream_id == id(event.stream) and seq <= event.seq:
                        del self.pending[(stream_id, seq)]

        monkeypatch.setattr(SideStream, "copy", copy)
        monkeypatch.setattr(device, "ordered", ordered)

    # ------------------------------------------------------------ windows: one per step
    def step(self, model) -> None:
        """One training step inside a window of the allocator (Note [the window])."""
        with no_dispatch():  # the arena the plan installs is not the device's own storage
            self.replay.begin()
        train(model, 1)
        with no_dispatch():
            self.replay.end()


def _train_under_the_shadow(monkeypatch, *, hold: bool, steps: int = 4) -> ReplayShadow:
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
    with simulated_device(seed=7, max_delay_s=0.002, max_lag_s=0.002) as device:
        shadow = ReplayShadow(device, monkeypatch)
        for _ in range(steps):
            if hold:  # copies run only when forced: each stays pending as long as it can
                with device.hold(copies=True):
                    shadow.step(model)
            else:
                shadow.step(model)
    return shadow


@pytest.mark.parametrize("hold", [True, False], ids=["copies-held", "copies-late"])
def test_the_replay_allocator_never_hands_out_memory_a_pending_copy_uses(monkeypatch, hold):
    """The sanitizer's report is a false positive: every copy's device range is ordered for
    the compute stream before its storage dies, so the replay allocator reuses it safely."""
    shadow = _train_under_the_shadow(monkeypatch, hold=hold)
    figures = shadow.engine.stats()
    assert shadow.copies > 0 and shadow.untracked == 0  # every copy's device side was followed
    assert figures["plans"] >= 1 and figures["served"] > 0  # addresses replayed at planned offsets
    assert shadow.races == []


def test_the_check_catches_a_copy_source_dropped_before_its_copy_is_ordered(monkeypatch):
    """The mutation: the cpu tier drops its copy's source at once (what Note [no record_stream]
    forbids). The replay allocator then hands the source's range to the next request while
    the held copy still reads it: the race the check must see."""
    real_place = CpuTier.place

    def place(self, record):
        real_place(self, record)
        record.copy_source = None
        record.device_tensor = None

    monkeypatch.setattr(CpuTier, "place", place)
    shadow = _train_under_the_shadow(monkeypatch, hold=True, steps=2)
    assert shadow.races and "device-to-host" in shadow.races[0]
