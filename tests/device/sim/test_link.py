"""The simulated device's link model (the wind tunnel): copies take the link's time.

Wall-clock figures are asserted as lower bounds only (a loaded machine makes everything
slower, never faster); the order of transfers is asserted on the model's own bookkeeping.
"""

import time

import pytest
import torch

import actoff
from actoff.device.sim.link import Link, forget_lateness, sleep_until
from actoff.testing import simulated_device

RATE = 200e6  # bytes per second: 4 MB take 20 ms
NBYTES = 4_000_000
MODELLED_S = NBYTES / RATE


@pytest.fixture
def device():
    with simulated_device(seed=0, bandwidth=RATE, max_delay_s=0, max_lag_s=0, track_memory=False) as device:
        yield device


def _host_and_device(device):
    return device.host_empty(NBYTES), torch.ones(NBYTES, dtype=torch.uint8)


def _copy_timed(device, stream, dst, src):
    start, end = device.event(), device.event()
    start.record(stream)
    device.copy(stream, dst, src, "a test copy")
    end.record(stream)
    return start, end


def test_a_copy_takes_at_least_its_bytes_over_the_rate_and_elapsed_time_says_so(device):
    stream = device.new_stream()
    host, data = _host_and_device(device)
    began = time.perf_counter()
    start, end = _copy_timed(device, stream, host, data)
    end.synchronize()
    assert time.perf_counter() - began >= MODELLED_S
    assert start.elapsed_time(end) >= MODELLED_S * 1e3
    assert torch.equal(host, data)  # the bytes arrive as without a link
    link = device.links["device-to-host"]
    assert link.bytes == NBYTES and link.busy_s == pytest.approx(MODELLED_S)


def test_two_copies_in_one_direction_queue_even_on_two_streams(device):
    first, second = device.new_stream(), device.new_stream()
    (host_a, data_a), (host_b, data_b) = _host_and_device(device), _host_and_device(device)
    began = time.perf_counter()
    _, end_a = _copy_timed(device, first, host_a, data_a)
    _, end_b = _copy_timed(device, second, host_b, data_b)
    end_a.synchronize()
    end_b.synchronize()
    assert time.perf_counter() - began >= 2 * MODELLED_S
    a, b = device.links["device-to-host"].transfers
    assert max(a.start, b.start) >= min(a.end, b.end)  # one after the other, never together


def test_the_two_directions_run_at_once(device):
    out, back = device.new_stream(), device.new_stream()
    host, data = _host_and_device(device)
    host_in = device.host_empty(NBYTES)
    destination = torch.empty(NBYTES, dtype=torch.uint8)
    _, end_out = _copy_timed(device, out, host, data)
    _, end_in = _copy_timed(device, back, destination, host_in)
    end_out.synchronize()
    end_in.synchronize()
    (d2h,) = device.links["device-to-host"].transfers
    (h2d,) = device.links["host-to-device"].transfers
    # Each direction has a link of its own: the second copy did not queue behind the first.
    assert h2d.start < d2h.end and d2h.start < h2d.end


def test_compute_waiting_on_a_slow_copy_stalls_for_it(device):
    stream = device.new_stream()
    host, data = _host_and_device(device)
    _, end = _copy_timed(device, stream, host, data)
    device.current().wait_event(end)  # compute (the host here) depends on the copy
    waited_until = time.perf_counter()
    (transfer,) = device.links["device-to-host"].transfers
    assert waited_until >= transfer.end  # compute went on only once the link was done


def test_a_synchronous_pageable_copy_blocks_the_caller_at_the_pageable_rate(device):
    forget_lateness()  # what this thread overslept before is not repaid from this copy
    began = time.perf_counter()
    seconds = device.transfer(NBYTES, "device-to-host", pageable=True)
    assert seconds == pytest.approx(MODELLED_S / device.settings.pageable_rate)
    assert time.perf_counter() - began >= seconds


def test_training_under_a_slow_link_is_exact_and_pays_the_copies():
    from _helpers import make_model, train

    def run(policy, **device_args):
        model = make_model()
        if policy != "none":
            actoff.offload_(model, block_cls=actoff.reference.Block, policy=policy, min_bytes=0)
        with simulated_device(seed=0, max_delay_s=0, max_lag_s=0, **device_args) as device:
            history = train(model, 2)
        actoff.reset()
        return history, device

    expected, _ = run("none")
    actual, device = run("cpu", bandwidth="50MB/s")
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    out, back = device.links["device-to-host"], device.links["host-to-device"]
    assert out.bytes > 0 and back.bytes > 0
    assert out.busy_s >= out.bytes / 50e6 * 0.999  # every byte paid its time on the link


def test_the_link_rate_is_a_validated_setting():
    config = actoff.Config.from_env({"ACTOFF_SIM_DEVICE": "1", "ACTOFF_SIM_DEVICE_BANDWIDTH": "2GB/s"})
    assert config.sim_device_bandwidth == 2 * 10**9
    with pytest.raises(ValueError, match="ACTOFF_SIM_DEVICE=1 as well"):
        actoff.Config.from_env({"ACTOFF_SIM_DEVICE_BANDWIDTH": "2GB/s"})
    with pytest.raises(ValueError, match="has no unit"):
        actoff.Config.from_env({"ACTOFF_SIM_DEVICE": "1", "ACTOFF_SIM_DEVICE_BANDWIDTH": "2"})
    with pytest.raises(ValueError, match="expected a rate > 0"):
        actoff.Config(sim_device=True, sim_device_bandwidth="0GB/s")
    with pytest.raises(ValueError, match="moves nothing"):
        Link("device-to-host", 0)


def test_oversleeping_is_remembered_and_a_fresh_timeline_waits_in_full():
    from actoff.device.sim import link

    forget_lateness()
    start = time.perf_counter()
    time.sleep(0.02)  # a thread woken 20 ms late (a loaded machine) ...
    sleep_until(start + 0.001)
    assert link._lateness.seconds >= 0.019  # ... owes it: its next waits are that much shorter
    forget_lateness()
    assert link._lateness.seconds == 0.0
    began = time.perf_counter()
    sleep_until(began + 0.01)
    assert time.perf_counter() - began >= 0.01  # afresh: the whole wait


def test_the_device_times_its_link_and_events_by_the_clock_it_is_given():
    # A clock at half the wall's speed (as the tunnel's is while another process takes half the
    # CPU: Note [the device's clock]) makes a copy last twice its modelled time on the wall, and
    # the events' elapsed time is in that clock's seconds.
    started = time.perf_counter()

    def half_speed() -> float:
        return (time.perf_counter() - started) / 2

    forget_lateness()
    with simulated_device(
        seed=0, bandwidth=RATE, max_delay_s=0, max_lag_s=0, track_memory=False, clock=half_speed
    ) as device:
        wall = time.perf_counter()
        assert device.transfer(NBYTES, "device-to-host") == pytest.approx(MODELLED_S)
        assert time.perf_counter() - wall >= 2 * MODELLED_S
        host, data = _host_and_device(device)
        start, end = _copy_timed(device, device.new_stream(), host, data)
        device.current().wait_event(end)
        assert start.elapsed_time(end) >= MODELLED_S * 1e3
        assert device.links["device-to-host"].transfers[-1].end <= half_speed()
