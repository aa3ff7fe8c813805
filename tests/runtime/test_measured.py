"""The auto policy's real timing readers (actoff.runtime.measured): `forward_ms` and
`attention_ms` on a run of the simulated device, read as auto reads them.

Every other auto test replaces the two readers with fixed times (a loaded machine moves measured
times, and the plans with them). Here they run for real: values are asserted by what must hold
whatever the machine's load (a forward takes time, attention runs inside the forward), never
against wall-clock figures.
"""

import pytest
from _helpers import make_model, train

import actoff
import actoff.runtime.measured as measured
from actoff.reference import Block
from actoff.testing import simulated_device

# Every test enters a simulated device of its own (or none): once, in the plain pass.
pytestmark = pytest.mark.plain_pass_only

SEQ = 257


@pytest.fixture
def readings(monkeypatch):
    """What the real readers returned, per run state read: ``id -> {"forward": ms, "attention": ms}``."""
    read: dict[int, dict[str, float | None]] = {}
    real_forward, real_attention = measured.forward_ms, measured.attention_ms

    def read_forward(state):
        value = real_forward(state)
        read.setdefault(id(state), {})["forward"] = value
        return value

    def read_attention(state):
        value = real_attention(state)
        read.setdefault(id(state), {})["attention"] = value
        return value

    monkeypatch.setattr(measured, "forward_ms", read_forward)
    monkeypatch.setattr(measured, "attention_ms", read_attention)
    return read


@pytest.mark.no_sim_device
def test_auto_reads_a_forward_time_and_attention_inside_it_on_the_simulated_device(readings):
    # A budget of half keep's peak: auto measures at the floor (Note [measuring at the floor]
    # in actoff.runtime.auto), probes, then plans; a token-wise run times the attention calls.
    # Its device does not count memory: the plan places the blocks' bytes alone. The measuring
    # steps wait for every copy out: on this device those waits are timed as most of the
    # forward, which must still leave auto a forward time (it planned nothing, ever).
    model = make_model(0, num_layers=2)
    actoff.offload_(model, block_cls=Block, policy="keep", min_bytes=0)
    with simulated_device(seed=0) as device:
        train(model, 1, seq=SEQ)
    budget = device.memory.peak // 2
    actoff.reset()
    model = make_model(0, num_layers=2)
    actoff.offload_(model, block_cls=Block, policy="auto", min_bytes=0, gpu_budget=budget)
    with simulated_device(seed=0, track_memory=False):
        train(model, 4, seq=SEQ)
    stats = actoff.stats()
    assert stats.plan != "none", "the plan never ran: the readers gave auto no forward time"
    assert readings and all(read["forward"] > 0 for read in readings.values()), readings
    timed = [read for read in readings.values() if read.get("attention") is not None]
    assert timed, "attention was never timed"
    for read in timed:  # attention's calls run inside the forward: a share in (0, 1]
        assert 0 < read["attention"] <= read["forward"], read
    for decision in stats.auto.values():  # what auto kept of them
        # Strictly less: the MLP and the norms take time too (a share forced to 1, say by a lost
        # unit in observe(), would pass an "at most").
        assert decision.t_layer_ms > 0 and 0 < decision.attention_ms < decision.t_layer_ms
    for block in stats.blocks.values():
        assert block.forward_ms > 0 and block.measured_ms >= block.forward_ms


class _Watch:
    """A forward watch that says what it was told: ``elapsed`` milliseconds."""

    def __init__(self, elapsed: float) -> None:
        self.elapsed = elapsed

    def synchronize(self) -> None:
        pass

    def elapsed_ms(self) -> float:
        return self.elapsed


class _State:
    """The parts of an `AutoRun` the readers use: the forward's watch and the run's waits out."""

    def __init__(
        self,
        elapsed: float,
        out_wait: float,
        recompute: float = 0.0,
        wait: float = 0.0,
        place_wait: float = 0.0,
    ) -> None:
        self.forward_watch = _Watch(elapsed)
        figures = {
            "out_wait_ms": out_wait,
            "recompute_ms": recompute,
            "wait_ms": wait,
            "place_wait_ms": place_wait,
        }
        self.run = type("Run", (), {"stats": type("Stats", (), figures)()})()


def test_a_forward_timed_through_its_waits_takes_a_same_shaped_blocks_time():
    """(Note [a forward timed through its waits]) A streamed block that waits on its copies for
    95% of its forward was timed as the whole forward (42 ms where its compute is 10): the model
    then hid its copies behind 42 ms and kept it streamed. A block of the same shape timed apart
    from its waits gives it its forward; a block of another shape does not."""
    streamed, waited = _State(42.0, 40.0), _State(10.0, 0.0)
    assert measured.forward_ms(streamed) == 42.0 and not measured.timed_apart_from_waits(streamed)
    assert measured.forward_ms(waited) == 10.0 and measured.timed_apart_from_waits(waited)
    # A forward that waited a quarter of its time: its compute is the rest (20 ms less 5 of waits).
    assert measured.forward_ms(_State(20.0, 5.0)) == 15.0
    shape = {"input_bytes": 100, "attention_bytes": 50, "local_bytes": 400}
    entries = [
        measured.Measured("a", **shape, forward_s=0.042),
        measured.Measured("b", **shape, forward_s=0.010, compute_s=0.010),
        measured.Measured("c", input_bytes=7, forward_s=0.042),  # a shape of its own: its upper bound
    ]
    measured.stand_in_forwards(entries)
    assert [entry.forward_s for entry in entries] == [0.010, 0.010, 0.042]


def test_a_runs_measured_time_counts_the_waits_for_copies_out_as_the_plan_predicts_them():
    """A plan's time counts the copies out no compute hid (Note [one link] in actoff.step_time);
    the measured time left the waits for them out, so a step at the floor, where every copy is
    waited for, read 40% under its prediction every step. Compute 15 ms, 5 ms waiting for copies
    out, 7 ms of recompute, 3 ms waiting for copies back: 30 ms."""
    assert measured.measured_s(_State(20.0, 5.0, recompute=7.0, wait=3.0)) == pytest.approx(0.030)
    # a forward timed through its waits has them in its time already: not counted twice
    assert measured.measured_s(_State(42.0, 40.0, recompute=7.0, wait=3.0)) == pytest.approx(0.052)
    # and the waits for its copies when the next block was placed, in no forward's time
    assert measured.measured_s(_State(20.0, 5.0, place_wait=4.0)) == pytest.approx(0.024)


def test_the_waits_for_copies_out_when_the_next_block_is_placed_are_counted():
    """(Note [the waits at placing] in actoff.runtime.step) A run's copies out still under way
    when the next run is placed are waited for there, between the blocks' stopwatches: counted
    nowhere, a plan whose copies outlast the next forward read under its prediction. On a 10 MB/s
    simulated link with no copy window, each block's 2.5 MiB take about 270 ms, its neighbour's
    forward a few: the waits are the copies less the forwards beside them. A lower bound that a
    loaded machine keeps: the copies' time on the link less 10%, less twice a whole step under
    keep (more than the forwards the copies could hide behind)."""
    import time

    def forward_s(policy: str) -> tuple[float, dict]:
        actoff.reset()
        model = make_model(0, num_layers=3)
        actoff.offload_(model, block_cls=Block, policy=policy, min_bytes=0)
        with simulated_device(seed=0, bandwidth="10MB/s", track_memory=False, max_delay_s=0, max_lag_s=0):
            train(model, 1, seq=SEQ)  # warm-up: arenas, plans
            start = time.perf_counter()
            train(model, 1, seq=SEQ)
            return time.perf_counter() - start, actoff.stats().blocks

    keep_s, _ = forward_s("keep")
    _, blocks = forward_s("cpu")
    copies = [block for block in blocks.values() if block.copy_ms > 0]
    assert len(copies) >= 2
    placed = copies[:-1]  # the last block's copies are waited for at backward, not at a placing
    link_ms = [block.bytes_per_tier["cpu"] / 10e6 * 1e3 for block in placed]  # the copies on the link
    place_ms = [getattr(block, "place_wait_ms", 0.0) for block in placed]  # none before it was counted
    assert sum(place_ms) > 0, place_ms  # the forwards beside them never hide 267 ms of copies
    assert sum(place_ms) >= 0.9 * sum(link_ms) - 2 * keep_s * 1e3, (place_ms, link_ms, keep_s)
    # copy_ms runs from a copy's issue to its end, queueing included: no wait outlasts it
    assert all(wait <= block.copy_ms + 1.0 for wait, block in zip(place_ms, placed, strict=True))


def test_a_block_takes_the_least_forward_of_its_shape_even_timed_apart_from_its_waits():
    """(Note [a block's compute is its shape's least]) A streamed block timed apart from its waits
    still times its packs on a host device: 48 to 61 ms in the main run against 29 to 31 for a
    kept block of its shape. Its forward, the price of running it again, is its shape's least;
    a block of another shape keeps its own."""
    shape = {"input_bytes": 8, "attention_bytes": 4, "local_bytes": 16}
    streamed = measured.Measured("a", **shape, forward_s=0.055, compute_s=0.055)
    kept = measured.Measured("b", **shape, forward_s=0.030, compute_s=0.030)
    other = measured.Measured(
        "c", input_bytes=8, attention_bytes=0, local_bytes=16, forward_s=0.09, compute_s=0.09
    )
    measured.stand_in_forwards([streamed, kept, other])
    assert (streamed.forward_s, kept.forward_s, other.forward_s) == (0.030, 0.030, 0.09)
