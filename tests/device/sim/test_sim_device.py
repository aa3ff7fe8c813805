"""The simulated asynchronous device: CUDA's event and copy semantics, the race checker, its
memory count, and the ordering bugs of the CUDA paths that it makes visible on a CPU."""

import gc
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch
from _helpers import TESTS, assert_same_history, make_model, run_without_deadlock, train

import actoff
from actoff.device.base import StreamBackend, StreamTicket
from actoff.device.sim.device import RaceError, SimSettings, SimStreams
from actoff.reference import Block
from actoff.testing import device_memory, simulated_device
from actoff.tiers.cpu import CpuTier

pytestmark = pytest.mark.no_sim_device  # each test builds the simulated device it needs


@pytest.fixture
def streams():
    device = SimStreams(SimSettings(seed=3))
    yield device
    device.close()


# ---------------------------------------------------------------------- events and copies
def test_event_completes_late_and_elapsed_time_raises_until_then(streams):
    side = streams.new_stream()
    start, end = streams.event(), streams.event()
    with streams.hold(copies=True):
        start.record(side)
        end.record(side)
        assert not end.query()
        with pytest.raises(RuntimeError, match="Both events must be completed"):
            start.elapsed_time(end)
        end.synchronize()  # the host forces the stream
        assert end.query() and start.query()
    assert start.elapsed_time(end) >= 0.0
    assert streams.forced == 1 and streams.blocking_syncs == 1


def test_compute_events_complete_late(streams):
    event = streams.event()
    with streams.hold(copies=False, compute=True):
        event.record(streams.current())
        assert not event.query()
        event.synchronize()
    assert event.query()


def test_copy_destination_holds_poison_until_the_copy_runs(streams):
    backend = StreamBackend(torch.device("cpu"), streams)
    source = torch.arange(8, dtype=torch.float32)
    host = streams.host_empty(32).view(torch.float32)
    with streams.hold(copies=True):
        ticket = backend.copy_to_host(host, source, "a test copy")
        assert torch.isnan(host).all()  # read without a wait: garbage, as on a GPU
        ticket.synchronize()
    assert torch.equal(host, source)
    back, ticket = backend.copy_to_device(host)
    backend.wait(ticket)  # the compute stream waits: the copy has landed when compute reads
    assert torch.equal(back, source)


def test_a_copy_of_pageable_host_memory_has_run_when_it_returns(streams):
    """(Note [pageable fallback]) CUDA returns from a copy into pageable memory once it has run,
    and from one out of it once staged: the host waits, however long the device takes."""
    backend = StreamBackend(torch.device("cpu"), streams)
    source = torch.arange(8, dtype=torch.float32)
    host = backend.host_empty(32, pinned=False).view(torch.float32)
    with streams.hold(copies=True):
        backend.copy_to_host(host, source, "a test copy")
        assert torch.equal(host, source)  # no poison left to read
        back, _ = backend.copy_to_device(host)
        assert torch.equal(back, source)  # landed before compute waited for it
    assert streams.pageable_copies == 2 and streams.races == []


def test_integer_copies_are_poisoned_with_ones(streams):
    backend = StreamBackend(torch.device("cpu"), streams)
    host = streams.host_empty(64).view(torch.int64)
    with streams.hold(copies=True):
        ticket = backend.copy_to_host(host, torch.arange(8), "ints")
        assert (host == -1).all()
        ticket.synchronize()
    assert torch.equal(host, torch.arange(8))


def test_device_source_freed_before_the_copy_is_waited_for_is_a_race(streams):
    backend = StreamBackend(torch.device("cpu"), streams)
    host = streams.host_empty(4096).view(torch.float32)
    source = torch.randn(1024)
    ticket = backend.copy_to_host(host, source, "block 'x' record 0")
    del source  # the caching allocator could hand this memory out now
    backend.wait(ticket)
    with pytest.raises(RaceError, match="block 'x' record 0.*freed before the copy was waited for"):
        streams.surface()


def test_source_held_until_the_wait_is_no_race(streams):
    backend = StreamBackend(torch.device("cpu"), streams)
    host = streams.host_empty(4096).view(torch.float32)
    source = torch.randn(1024)
    ticket = backend.copy_to_host(host, source, "held")
    backend.wait(ticket)
    del source
    ticket.synchronize()
    streams.surface()
    assert streams.races == []


def test_host_buffer_reused_while_a_copy_touches_it_is_a_race(streams):
    backend = StreamBackend(torch.device("cpu"), streams)
    host = streams.host_empty(4096).view(torch.float32)
    source = torch.randn(1024)
    with streams.hold(copies=True):
        backend.wait(backend.copy_to_host(host, source, "slot copy"))
        backend.check_host_reuse(host, "freed")  # the compute wait does not tell the host
    with pytest.raises(RaceError, match="slot copy: host memory was freed"):
        streams.surface()


def test_a_freed_host_buffers_addresses_become_device_memory_again(streams):
    # (Note [host ranges die with their buffer]) the CPU allocator hands a freed host chunk's
    # addresses to the next tensor; a copy into it is host-to-device, and compute waits for it.
    host = streams.host_empty(1 << 20)
    address = host.data_ptr()
    assert streams.is_host(host)
    del host
    gc.collect()
    assert not streams.is_host(SimpleNamespace(data_ptr=lambda: address))


def test_a_host_buffer_lives_as_long_as_a_view_of_it(streams):
    """The range goes with the storage, not the first tensor: a view still reads host memory."""
    buffer = streams.host_empty(1 << 20)
    start, view = buffer.data_ptr(), buffer[4096:]
    del buffer
    assert streams.is_host(view)  # a view keeps the storage
    del view
    gc.collect()
    assert start not in streams._host_ranges


def test_device_memory_counts_storages_and_enforces_capacity():
    with simulated_device(seed=0, capacity=4096) as device:
        a = torch.empty(512, dtype=torch.float32)  # 2 KiB
        view = a[:256]
        assert device.memory.live == 2048 and device.memory.peak == 2048
        with pytest.raises(torch.OutOfMemoryError, match="simulated device out of memory"):
            torch.empty(1024, dtype=torch.float32)
        del a, view
        assert device.memory.live == 0
        assert device.memory.peak == 2048


def test_a_capacity_set_inside_a_simulated_device_block_is_refused_not_dropped():
    """device_memory counts the enclosing simulated_device's memory; a different capacity asked
    of the setting there would be ignored, so the call names the conflict instead."""
    config = actoff.Config(sim_device=True, sim_device_memory="1MiB")
    refused = pytest.raises(ValueError, match="pass capacity= to simulated_device")
    with simulated_device(seed=0), refused, device_memory(config):
        pass
    with simulated_device(seed=0, capacity=2**20) as device, device_memory(config) as memory:
        assert memory is device.memory and memory.capacity == 2**20


def test_the_memory_setting_caps_the_device_of_the_setting(monkeypatch):
    """ACTOFF_SIM_DEVICE_MEMORY: inside `device_memory` an allocation past the cap raises the
    type CUDA raises; the scopes train on that same device, whose host buffers do not count."""
    monkeypatch.setenv("ACTOFF_SIM_DEVICE", "1")
    monkeypatch.setenv("ACTOFF_SIM_DEVICE_MEMORY", "64KiB")
    actoff.set_config()
    with device_memory() as memory:
        kept = torch.empty(8192, dtype=torch.float32)  # 32 KiB
        with pytest.raises(torch.OutOfMemoryError, match="ACTOFF_SIM_DEVICE_MEMORY"):
            torch.empty(8192 + 1, dtype=torch.float32)
        assert memory.live == 32 * 2**10 and memory.capacity == 64 * 2**10
        del kept
    # Outside the block nothing is counted, and nothing is capped.
    torch.empty(2**20)
    assert memory.live == 0
    # A model under the cpu policy, built inside the block: its weights count. Room for little
    # more than the weights is out of memory in the step; 64 MiB trains, with the host arena
    # outside the count.
    weights = sum(p.numel() * p.element_size() for p in make_model().parameters())
    for cap, fits in ((f"{weights // 1024 + 16}KiB", False), ("64MiB", True)):
        monkeypatch.setenv("ACTOFF_SIM_DEVICE_MEMORY", cap)
        actoff.set_config()
        actoff.reset()
        with device_memory() as memory:
            model = _policy_model("cpu")
            tokens = torch.randint(0, 256, (2, 64))
            if fits:
                model.loss(tokens).backward()
                assert 0 < memory.peak <= 64 * 2**20
                assert actoff.stats().total_bytes_offloaded > 0
            else:
                with pytest.raises(torch.OutOfMemoryError):
                    model.loss(tokens).backward()


def test_device_memory_needs_the_simulated_device():
    with pytest.raises(RuntimeError, match="set ACTOFF_SIM_DEVICE=1"), device_memory():
        pass


def test_setting_and_context_select_the_simulated_device(monkeypatch):
    monkeypatch.setenv("ACTOFF_SIM_DEVICE", "1")
    assert actoff.Config.from_env().sim_device is True
    monkeypatch.setenv("ACTOFF_SIM_DEVICE", "maybe")
    with pytest.raises(ValueError, match="ACTOFF_SIM_DEVICE"):
        actoff.Config.from_env()


# ---------------------------------------------------------------------- the CUDA paths' bugs
def _policy_model(policy, **kwargs):
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy=policy, min_bytes=0, **kwargs)
    return model


def test_stall_waits_for_its_marker_as_well_as_the_copy(streams):
    """Problem 1: the stall ticket paired a compute-stream marker with the copy's end and
    reported done on the copy alone: elapsed time then raised on a marker not yet run (the
    first prefetched record of the first backward on CUDA)."""
    backend = StreamBackend(torch.device("cpu"), streams)
    host = streams.host_empty(4096).view(torch.float32)
    ticket = backend.copy_to_host(host, torch.randn(1024), "stall")
    ticket.synchronize()
    with streams.hold(copies=False, compute=True):
        stall = backend.stall(ticket)
        assert not stall.query()  # the marker on the compute stream has not run
        stall.synchronize()
    assert stall.query() and stall.elapsed_ms() >= 0.0


def test_training_on_a_lagging_device_is_exact():
    """Problem 1 end to end: compute events lag; the cpu tier's timings must not raise."""
    expected = train(make_model(), 2)
    model = _policy_model("cpu")
    with simulated_device(seed=5, max_lag_s=0.005) as device, device.hold(copies=True, compute=True):
        actual = train(model, 2)
    assert_same_history(expected, actual)
    assert device.races == []


def test_graph_dropped_without_backward_frees_its_slots_only_after_the_copies():
    """Problem 2: release waited stream-side only; a freed slot could be refilled (an NVMe
    read) while the copy into it still ran."""
    model = _policy_model("cpu")
    with simulated_device(seed=1) as device:
        with device.hold(copies=True):
            loss = model.loss(torch.randint(0, 256, (2, 33)))
            del loss  # no backward: every record is released with its copy still queued
            arena = next(iter(actoff.runtime.runtime.get_runtime().arenas.values()))
            assert arena.deferred > 0
        train(model, 1)  # the next step reuses the slots once their copies are done
    assert device.races == []


def test_staged_nvme_frees_the_device_before_the_disk_and_never_waits_for_it(nvme_dir, monkeypatch):
    """Problem 3: staged writes kept the device tensor until the disk was done, and the
    forced path waited for the disk in forward (here: for a disk that never finishes)."""
    from actoff.tiers.nvme.store import NvmeStore

    gate = threading.Event()
    real_write = NvmeStore.write

    def held_write(self, buffer, nbytes, **where):
        extent, future = real_write(self, buffer, nbytes, **where)
        return extent, _HeldFuture(future, gate)

    monkeypatch.setattr(NvmeStore, "write", held_write)
    expected = train(make_model(), 1)
    model = _policy_model("nvme", nvme_dir=nvme_dir)
    with simulated_device(seed=2):
        generator = torch.Generator().manual_seed(1)
        loss = model.loss(torch.randint(0, 256, (2, 33), generator=generator))  # disk held
        step = actoff.runtime.runtime.get_runtime().step
        forced = [
            r for run in step.runs[:-1] for r in run.records if r.tier is not None and r.tier.name == "nvme"
        ]
        assert forced and all(r.device_tensor is None for r in forced)  # memory back at once
        assert all(r.state.value == "offloading" for r in forced)  # the disk is not done
        gate.set()
        loss.backward()
        assert_same_history(expected, [(loss.detach(), {n: p.grad for n, p in model.named_parameters()})])


class _HeldFuture:
    """A write future that is not done until ``gate`` opens."""

    def __init__(self, future, gate):
        self.future, self.gate = future, gate

    def done(self):
        return self.gate.is_set() and self.future.done()

    def wait(self, timeout=None):
        if not self.gate.wait(30):
            raise TimeoutError("the forward waited for the disk")
        return self.future.wait(timeout)

    def elapsed(self):
        return self.future.elapsed()


def test_a_graph_the_collector_frees_while_the_device_holds_its_lock_is_released():
    # The collector may free a graph in a cycle (an exception's traceback: test_nvme's
    # hung-read test leaves one) while the device holds its lock, in a drain at the end of a
    # `simulated_device` block; releasing the graph's records orders their copies, which takes
    # that lock again. It hung; here the collector runs in exactly that place, in a process of
    # its own that a deadlock cannot take the suite down with.
    script = textwrap.dedent(
        f"""
        import gc, sys, torch
        sys.path.insert(0, {TESTS!r})
        import actoff, actoff.device.sim.device
        from _helpers import make_model
        from actoff.reference import Block
        from actoff.testing import simulated_device

        with simulated_device(seed=4) as device:
            model = make_model()
            actoff.offload_(model, block_cls=Block, policy="cpu", min_bytes=0)
            cycle = [model.loss(torch.randint(0, 256, (2, 33)))]
            cycle.append(cycle)  # garbage only the collector finds; copies still in flight
            del cycle
            real_use_count = actoff.device.sim.device._use_count

            def collecting_use_count(tensor):
                gc.collect()  # as if an allocation under the device's lock started the collector
                return real_use_count(tensor)

            actoff.device.sim.device._use_count = collecting_use_count
            device.drain()
        print("drained")
        """
    )
    run_without_deadlock(script, "drained", "the device", timeout=60)


def test_a_process_that_exits_with_copies_in_flight_exits_cleanly():
    # (Note [stop before the interpreter exits]) a worker still inside a copy when the
    # interpreter finalized aborted the process (seen as test_nvme's SIGTERM test ending with
    # SIGABRT on the simulated device). Here long copies are queued just before the exit.
    script = textwrap.dedent(
        """
        import sys, time, torch
        from actoff.device.sim.device import SimSettings, SimStreams

        streams = SimStreams(SimSettings(max_delay_s=0.0, max_lag_s=0.0))
        side = streams.new_stream()
        source = torch.ones(50_000_000)  # 200 MB: copies that run while the interpreter exits
        destination = torch.empty_like(source)
        for _ in range(4):
            streams.copy(side, destination, source, "a long copy")
        time.sleep(0.01)
        sys.exit(3)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr


def test_backward_never_blocks_the_host_on_a_copy():
    """Problem 4: release() synchronized the host on each fetched record's copy, so the
    autograd thread could not run ahead of the copy stream."""
    model = _policy_model("cpu")
    train(model, 1)
    with simulated_device(seed=4) as device:
        loss = model.loss(torch.randint(0, 256, (2, 33)))
        before = device.host_syncs
        loss.backward()
        assert device.host_syncs == before
    assert device.races == []


# ---------------------------------------------------------------------- the model has teeth
def _broken_run_is_caught(**patches):
    """Train under a broken backend: a race is raised, or the gradients differ."""
    expected = train(make_model(), 2)
    model = _policy_model("cpu")
    try:
        with simulated_device(seed=6) as device, device.hold(copies=True):
            actual = train(model, 2)
    except RaceError:
        return
    except RuntimeError as error:  # CUDA's own check: timing an event that has not run
        assert "Both events must be completed" in str(error)
        return
    with pytest.raises(AssertionError):
        assert_same_history(expected, actual)


def test_mutation_wait_that_does_nothing_is_caught(monkeypatch):
    monkeypatch.setattr(StreamBackend, "wait", lambda self, ticket: None)
    _broken_run_is_caught()


def test_mutation_ticket_done_early_is_caught(monkeypatch):
    monkeypatch.setattr(StreamTicket, "query", lambda self: True)
    _broken_run_is_caught()


def test_mutation_copy_source_dropped_early_is_caught(monkeypatch):
    real_place = CpuTier.place

    def place(self, record):
        real_place(self, record)
        record.copy_source = None
        record.device_tensor = None

    monkeypatch.setattr(CpuTier, "place", place)
    _broken_run_is_caught()


@pytest.mark.parametrize("lag_s", [0.0, 0.01])
def test_offloading_lowers_the_device_peak_however_late_the_copies_run(lag_s):
    """(Note [copy sources and the allocator]) once the compute stream has waited for a copy out,
    the caching allocator hands the source's memory to new work when its owner drops it, even if
    the copy has not run yet. The memory model used to keep the source live until the copy ran,
    so late copies made offloading look useless (no saving at 10 ms of lag)."""
    from actoff.reference import ModelConfig, Transformer

    def peak(policy):
        actoff.reset()
        torch.manual_seed(0)
        model = Transformer(ModelConfig.preset("tiny", num_layers=8))
        actoff.offload_(model, block_cls=Block, policy=policy, min_bytes=0)
        tokens = torch.randint(0, 256, (2, 257))
        with simulated_device(seed=5, max_delay_s=lag_s, max_lag_s=lag_s) as device:
            model.loss(tokens).backward()  # warm-up: arenas and plans
            device.drain()
            device.memory.reset_peak()
            model.loss(tokens).backward()
            device.drain()
            return device.memory.peak, actoff.stats().total_bytes_offloaded

    keep_peak, _ = peak("keep")
    cpu_peak, offloaded = peak("cpu")
    assert offloaded > 0
    # Resident at the peak: about two runs' activations and the device arena's two fetch
    # buffers, of eight runs offloaded.
    assert keep_peak - cpu_peak >= 0.5 * offloaded


def test_the_host_link_is_measured_on_what_a_small_device_has():
    """Found trying auto on a Hugging Face Llama under a 64 MiB simulated device: the link's
    measurement at the end of the first step asked for 64 MiB of device memory and raised out of
    memory in the middle of training. It now halves its buffer until one fits."""
    with simulated_device(seed=0, capacity="8MiB") as streams:
        backend = StreamBackend(torch.device("cpu"), streams)
        assert backend.host_bandwidth() > 0
        assert streams.memory.live == 0  # its buffers are gone
        with pytest.raises(torch.OutOfMemoryError):  # under 1 MiB free: a real shortage, said so
            held = torch.empty(7 * 2**20 + 2**19, dtype=torch.uint8)
            backend.host_bandwidth()
        del held


@pytest.mark.parametrize("rate", ["300MB", "1GB"])
def test_the_link_is_timed_not_read_from_the_model(rate):
    """Note [timing the link]: auto plans with the rate it timed, on the simulated device as on
    CUDA (it had been handed the modelled rate). Copies run over the link, each long enough to
    read (10 ms at least, or 64 MiB), and none beats the link: the rate is at most the model's
    (to the clock's resolution). How far under it depends on the machine's load (a busy 2-core
    machine read 794 MB/s of a 1 GB/s link), which a test does not assert on."""
    model = actoff.parse_size(rate, what="rate")
    with simulated_device(seed=0, bandwidth=rate) as streams:
        backend = StreamBackend(torch.device("cpu"), streams)
        measured = backend.host_bandwidth()
        assert streams.memory.live == 0
        timed = streams.links["device-to-host"].transfers
    # Timed on copies over the link (none had run: the rate was read), each >= 10 ms of it.
    assert len(timed) >= 4 and all(t.end - t.start >= 0.010 for t in timed[-3:]), timed
    assert 0 < measured <= 1.01 * model, (measured, model)
