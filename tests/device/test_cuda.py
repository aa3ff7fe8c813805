"""CUDA's memory watch reads the allocator's own peak (Note [one peak counter, two readers]).

On a CPU the allocator's counters are a stand-in with torch's semantics (``memory_stats_as_nested_dict``'s keys,
``reset_peak_memory_stats`` starting the peak from what is live); on a GPU, auto's measured peak
is held against the allocator's."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import actoff
import actoff.device.cuda as cuda
from actoff.device.cuda import AllocatorPeak, CudaStreams, peak_counters


class FakeAllocator:
    """torch's caching allocator's counters, as ``torch.cuda.memory_stats_as_nested_dict`` shows them."""

    def __init__(self) -> None:
        self.live = self.peak = self.reserved = self.reserved_peak = 0

    def allocate(self, nbytes: int) -> None:
        self.live += nbytes
        self.reserved = max(self.reserved, self.live)
        self.peak, self.reserved_peak = max(self.peak, self.live), max(self.reserved_peak, self.reserved)

    def free(self, nbytes: int) -> None:
        self.live -= nbytes

    def memory_stats_as_nested_dict(self, device=None) -> dict:
        return {
            "allocated_bytes": {"all": {"current": self.live, "peak": self.peak}},
            "reserved_bytes": {"all": {"current": self.reserved, "peak": self.reserved_peak}},
        }

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak, self.reserved_peak = self.live, self.reserved


@pytest.fixture
def allocator(monkeypatch):
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", fake.memory_stats_as_nested_dict)
    # Both names torch exports it under: the watch wraps both, and the test puts both back.
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda.memory, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(cuda, "_COUNTERS", {})
    monkeypatch.setattr(cuda, "_torch_reset", None)
    monkeypatch.setattr(cuda, "_other_allocator", None)  # ACTOFF_ALLOCATOR=replay installs one on import
    return fake


def test_a_transient_between_two_looks_counts(allocator):
    # A block's scratch allocated and freed between the watch's samples: the bytes live at each
    # sample are 100 and 100, the window's peak 600 (sampling live bytes said 100).
    allocator.allocate(100)
    watch = AllocatorPeak(peak_counters(torch.device("cuda", 0)))
    watch.sample()
    allocator.allocate(500)
    allocator.free(500)
    watch.sample()
    assert watch.peak == 600
    watch.reset()  # the next window starts from what is live
    assert watch.peak == 100
    allocator.allocate(50)
    allocator.free(50)
    watch.sample()
    assert watch.peak == 150


def test_the_programs_peak_survives_the_watchs_restarts(allocator):
    streams = CudaStreams(torch.device("cuda", 0))
    watch = streams.memory_watch()
    allocator.allocate(1000)  # the program's peak, inside auto's first window
    allocator.free(1000)
    for _ in range(3):  # auto's windows go on after it
        watch.reset()
        allocator.allocate(10)
        watch.sample()
    assert allocator.peak < 1000  # torch's own counter restarted by the watch: undercounts
    assert streams.memory_peak() == 1000  # actoff's readers carry it
    assert streams.memory_peak(reset=True) == 1000
    assert streams.memory_peak() == allocator.live == 30  # started again from now
    allocator.allocate(70)
    allocator.free(70)
    watch.reset()
    assert streams.memory_peak() == 100


def test_one_watchs_window_never_cuts_anothers_short(allocator):
    # Two runtimes (threads) watch one device; a report resets the program's figures between
    # steps. Each restart hands the peak it ends to every watch.
    counters = peak_counters(torch.device("cuda", 0))
    first, second = AllocatorPeak(counters), AllocatorPeak(counters)
    allocator.allocate(800)
    allocator.free(800)
    first.reset()  # the first thread's window ends: the second's goes on
    allocator.allocate(100)
    first.sample(), second.sample()
    assert second.peak == 800 and first.peak == 100
    allocator.allocate(300)
    allocator.free(300)
    counters.program_peaks(reset=True)  # actoff.report(reset_peak=True)
    first.sample(), second.sample()
    assert first.peak == 400 and second.peak == 800  # the report did not end either window


def _watching_after_a_peak(allocator: FakeAllocator) -> tuple[CudaStreams, AllocatorPeak]:
    """A device's streams and auto's watch of it, after a window with a 1000-byte peak ended."""
    streams = CudaStreams(torch.device("cuda", 0))
    watch = streams.memory_watch()
    allocator.allocate(1000)
    allocator.free(1000)
    watch.reset()
    return streams, watch


def test_the_programs_own_reset_starts_its_figures_again(allocator):
    # A logger resets torch's counter between its reports while auto watches: its next figure is
    # the peak since its reset, not one auto carried from before it (it said 1000 for 10).
    streams, watch = _watching_after_a_peak(allocator)
    torch.cuda.reset_peak_memory_stats(torch.device("cuda", 0))  # the program's, through torch
    allocator.allocate(10)
    allocator.free(10)
    assert streams.memory_peak() == 10
    # A reset by another path (the counter's peak goes down) is seen at the next read.
    allocator.allocate(500)
    allocator.free(500)
    watch.reset()  # carries 500
    allocator.allocate(200)
    allocator.free(200)
    watch.sample()
    allocator.reset_peak_memory_stats()  # not through torch.cuda: the wrapper never hears of it
    assert streams.memory_peak() == 0 and watch.peak == 200  # the watch keeps its window's peak


def test_torch_accelerators_reset_is_heard_too_and_nothing_is_wrapped_twice(allocator):
    streams, watch = _watching_after_a_peak(allocator)
    allocator.allocate(300)  # live bytes grew: the counter's peak would not go down
    torch.accelerator.reset_peak_memory_stats(0)
    assert streams.memory_peak() == 300
    wrapped = torch.cuda.reset_peak_memory_stats
    cuda._torch_reset = None  # as if a second runtime installed the wrappers again
    cuda.watch_program_resets()
    assert cuda._torch_reset == allocator.reset_peak_memory_stats  # torch's (here the stand-in), unwrapped
    assert torch.cuda.reset_peak_memory_stats is not wrapped  # rewrapped around torch's, not around ours
    watch.reset()  # auto's own restart is not the program's: the carried peak stays
    assert streams.memory_peak() == 300


def test_watches_made_while_another_thread_restarts_never_raise(allocator):
    counters = peak_counters(torch.device("cuda", 0))
    errors, stop = [], threading.Event()

    def restart():
        try:
            while not stop.is_set():
                counters.program_peaks(reset=True)
        except RuntimeError as error:  # "Set changed size during iteration" without the lock
            errors.append(error)

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        watches = [AllocatorPeak(counters) for _ in range(3000)]
    finally:
        stop.set()
        thread.join()
    assert not errors and len(counters.watches) == len(watches)


def test_a_device_without_figures_reads_none_or_nothing(allocator, monkeypatch):
    streams = CudaStreams(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {})
    assert streams.memory_peak() == 0  # CUDA not initialised: nothing allocated yet

    def refuse(device=None):
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", refuse)
    assert streams.memory_peak() is None  # an allocator that keeps no statistics


def test_the_devices_share_nothing(allocator, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert peak_counters(torch.device("cuda")) is peak_counters(torch.device("cuda", 1))
    assert peak_counters(torch.device("cuda", 0)) is not peak_counters(torch.device("cuda", 1))


class Spiky(nn.Module):
    """A block whose forward holds a large scratch tensor for a moment: invisible at its edges."""

    def __init__(self, width: int, scratch_bytes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scratch_bytes = scratch_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(self.scratch_bytes // 4, device=x.device)
        y = torch.relu(self.linear(x)) + scratch[:1]
        del scratch
        return y


@pytest.mark.gpu
def test_auto_measures_a_blocks_transient_on_cuda():
    scratch = 256 * 2**20
    torch.manual_seed(0)
    model = nn.Sequential(*(Spiky(1024, scratch) for _ in range(4))).cuda()
    actoff.reset()
    actoff.offload_(model, block_cls=Spiky, policy="auto", min_bytes=0, gpu_budget="60GiB")
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
    true_peaks, checked = [], 0
    for _ in range(5):
        before = torch.cuda.memory_allocated()
        actoff.report(reset_peak=True)
        model(x).sum().backward()
        torch.cuda.synchronize()
        true_peaks.append(actoff.report().device_peak_bytes)
        measured = actoff.stats().measured_peak_bytes  # a step auto checked (None while it measures)
        if measured is not None:
            checked += 1
            # Each block's scratch is more than every activation of the step together (4 blocks
            # of 2 x 16 MiB): the block-edge samples saw none of it.
            assert measured >= before + scratch
            assert measured <= max(true_peaks)
    assert checked >= 2
