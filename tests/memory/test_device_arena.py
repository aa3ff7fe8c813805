"""The device arena: actoff's device buffers in backward from a buffer per wave at planned offsets,
on the simulated device (the CUDA code paths on a CPU, copies poisoned until they land)."""

import dataclasses
import weakref

import pytest
import torch
from _helpers import assert_history_as_placed, assert_same_history, make_model, train

import actoff
from actoff import planner
from actoff.device.base import StreamBackend
from actoff.device.sim.device import RaceError, SimSettings, SimStreams
from actoff.memory.device_arena import DeviceArena
from actoff.memory.device_plans import DevicePlan
from actoff.reference import Block
from actoff.runtime.runtime import get_runtime
from actoff.testing import simulated_device

pytestmark = pytest.mark.no_sim_device  # each test builds the simulated device it inspects

POLICIES = {
    "cpu": {"policy": "cpu"},
    "nvme": {"policy": "nvme"},
    "tokenwise": {"policy": "tokenwise", "cpu_fraction": 0.5},
}


def _offloaded(settings: dict, nvme_dir=None, **overrides) -> torch.nn.Module:
    model = make_model()
    extra = {"nvme_dir": nvme_dir} if settings["policy"] == "nvme" else {}
    actoff.offload_(model, block_cls=Block, min_bytes=0, **settings, **extra, **overrides)
    return model


def _hull_sizes(arena: DeviceArena) -> list[int]:
    """The sizes of the plan's parts' ranges (a wave of a run's fetches or rebuilds), smallest first."""
    hulls = []
    for keys in arena.parts.values():
        ranges = [arena.plan[key][:2] for key in keys]
        hulls.append(max(offset + size for size, offset in ranges) - min(offset for _, offset in ranges))
    return sorted(hulls)


def _arena() -> DeviceArena:
    (arena,) = get_runtime().arenas.on_device.values()
    return arena


def _steps(model, device, lengths, history=None) -> list[tuple[int, int, int, int] | None]:
    """One SGD step per sequence length, the copies out held back during forward (so which
    records backward finds still on the device does not depend on timing); per step the arena's
    requests, those served as planned, divergences and fallbacks (None without an arena).
    ``history`` gets each step's loss and gradients. ``model`` may be a list, used in turns."""
    models = model if isinstance(model, list) else [model]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    generator = torch.Generator().manual_seed(1)
    figures = []
    for step, length in enumerate(lengths):
        model, optimizer = models[step % len(models)], optimizers[step % len(models)]
        tokens = torch.randint(0, 256, (2, length), generator=generator)
        device.drain()  # the previous step's copies: nothing left to force open the hold
        with device.hold(copies=True):
            loss = model.loss(tokens)
        loss.backward()
        if history is not None:
            history.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        arenas = list(get_runtime().arenas.on_device.values())
        figures.append(
            (arenas[0].requests, arenas[0].served, arenas[0].divergences, arenas[0].fallbacks)
            if arenas
            else None
        )
    return figures


def _device_allocations(monkeypatch) -> list[int]:
    """Numbers of elements of every device allocation the backend makes from now on."""
    made = []
    real = StreamBackend.device_empty

    def spy(self, numel, dtype):
        made.append(numel)
        return real(self, numel, dtype)

    monkeypatch.setattr(StreamBackend, "device_empty", spy)
    return made


def _device_plans() -> list:
    return [layout for key, layout in get_runtime().layouts.items() if key.startswith("device-arena:")]


def test_a_buffer_per_wave_serves_every_request_and_lives_only_while_its_tenants_do(monkeypatch):
    """(Note [a buffer per wave]) after the traced step, each step takes one buffer per part (a
    wave of a run's fetches), of its planned range (fewer buffers than requests), the same sizes
    every step; none is taken in forward, the arena lets each go at its last request, and each
    is gone once its tenants are: nothing is alive after backward."""
    made = _device_allocations(monkeypatch)
    most_held = [0]
    real_buffer = DeviceArena._buffer

    def taking(self, part):
        held = real_buffer(self, part)
        most_held[0] = max(most_held[0], len(self.buffers))
        return held

    monkeypatch.setattr(DeviceArena, "_buffer", taking)
    model = make_model(num_layers=4)
    actoff.offload_(model, block_cls=Block, min_bytes=0, policy="cpu")
    with simulated_device(seed=11) as device:
        first = _steps(model, device, [33])  # traced: every request a new allocation
        assert len(made) == first[0][0] > 0 and most_held == [0]
        planned = _steps(model, device, [33] * 4)
        arena = _arena()
        device.drain()  # as `_steps` does: which records backward finds on the device is fixed
        with device.hold(copies=True):
            loss = model.loss(torch.randint(0, 256, (2, 33)))
        taken_in_forward = arena.num_allocations
        loss.backward()
        assert taken_in_forward == 4 * len(arena.parts)  # nothing taken in forward ...
        assert arena.num_allocations == taken_in_forward + len(arena.parts)  # ... all in backward
    assert arena.buffers == {} and arena.capacity == 0
    ranges = _hull_sizes(arena)
    assert {part[:2] for part in arena.parts} == {(run, "fetch") for run in range(3)}  # all but the last
    assert len(ranges) < first[0][0]  # a buffer per wave, not per request
    per_step = made[first[0][0] :]
    count = len(ranges)
    assert [sorted(per_step[i : i + count]) for i in range(0, len(per_step), count)] == [ranges] * 5
    assert arena.num_allocations == actoff.stats().device_allocations == 5 * count
    assert most_held == [1]  # a run's fetches are requested together: each wave let go at once
    # (a part with a request still to come when the next is taken would make it 2)
    assert 0 < actoff.stats().device_arena_bytes <= sum(ranges)
    assert all(
        requests == served > 0 and not diverged and not fell_back
        for requests, served, diverged, fell_back in planned
    )
    assert device.races == []


@pytest.mark.parametrize("policy", list(POLICIES))
def test_live_buffers_never_share_bytes_and_gradients_are_exact(policy, nvme_dir, monkeypatch):
    """Every request's bytes and lifetime, from the arena's own view (its tenants' storages):
    two alive together never overlap. Overlap would also show as wrong gradients: a copy
    poisons its destination until it lands."""
    clock, tenants = [0], []
    real = DeviceArena.empty

    def died(entry):
        clock[0] += 1
        entry[3] = clock[0]

    def spy(self, numel, dtype, key, tag=None):
        tenant = real(self, numel, dtype, key, tag)
        clock[0] += 1
        entry = [tenant.data_ptr(), tenant.data_ptr() + numel * dtype.itemsize, clock[0], None]
        tenants.append(entry)
        weakref.finalize(tenant.untyped_storage(), died, entry)
        return tenant

    monkeypatch.setattr(DeviceArena, "empty", spy)
    expected = train(make_model(), 4)
    model = _offloaded(POLICIES[policy], nvme_dir)
    with simulated_device(seed=12) as device:
        actual = train(model, 4)
    # Bit for bit for whole tiers; poison (NaN) or another buffer's bytes fail either check.
    assert_history_as_placed(expected, actual, recomputed=policy == "tokenwise")
    assert device.races == []
    arena = _arena()
    # Planned, same shape; token-wise: the first step stores whole (its probe runs in that
    # backward) and the next splits, one change of shape the arena plans anew.
    assert arena.num_allocations >= 1 and (policy == "tokenwise" or arena.total_divergences == 0)
    assert all(end is not None for *_, end in tenants)  # every tenant died with its step
    for i, (low, high, born, died) in enumerate(tenants):
        for other_low, other_high, other_born, other_died in tenants[i + 1 :]:
            if born < other_died and other_born < died:  # alive together
                assert high <= other_low or other_high <= low, "two live device buffers share bytes"


def test_an_overlap_would_be_caught(monkeypatch):
    """The check has teeth: an arena that puts every request at offset 0 and never looks at its
    live tenants hands out bytes in use, and the poison of the next copy reaches compute."""
    real_install = DeviceArena.install_plan

    def everything_at_zero(self, plan):  # and one buffer per run
        keys, sizes = list(plan.offsets), [size for size, *_ in plan.offsets.values()]
        at_zero = dataclasses.replace(plan.layout, offsets=(0,) * len(keys))
        real_install(self, DevicePlan(keys, sizes, at_zero, [key[:2] for key in keys]))

    monkeypatch.setattr(DeviceArena, "install_plan", everything_at_zero)
    monkeypatch.setattr("actoff.memory.device_arena._free", lambda live, offset, size: True)
    expected = train(make_model(), 3)
    model = _offloaded(POLICIES["cpu"])
    with pytest.raises((AssertionError, RaceError)):
        with simulated_device(seed=13):
            actual = train(model, 3)
        assert_same_history(expected, actual)


@pytest.mark.parametrize("policy", ["cpu", "tokenwise"])
def test_an_older_steps_graph_freed_in_backward_leaves_the_current_buffer(policy, monkeypatch):
    """A graph kept from an earlier step (its backward ran with ``retain_graph``), freed in the
    middle of the current backward (inside a block's backward: its rebuilds are under way),
    brings back the older step's records: that must not give back the buffers the current
    backward is using, those of the runs at the same places included (their next requests would
    take second ones)."""
    model = make_model(num_layers=4)
    actoff.offload_(model, block_cls=Block, min_bytes=0, **POLICIES[policy])
    made = _device_allocations(monkeypatch)
    tokens = torch.randint(0, 256, (2, 33))
    with simulated_device(seed=16) as device:
        _steps(model, device, [33] * 2)  # planned
        device.drain()
        # Copies held during forward as in the planned steps (`_steps`): which records backward
        # finds still on the device must not depend on the machine's load (CI failed on it).
        with device.hold(copies=True):
            kept = [model.loss(tokens)]
        kept[0].backward(retain_graph=True)  # a step whose graph is kept
        model.layers[2].attn.register_full_backward_pre_hook(lambda *_: kept.clear())
        with device.hold(copies=True):
            loss = model.loss(tokens)  # its backward began: a new step
        before = len(made)
        loss.backward()
        assert not kept
    arena = _arena()
    hulls = _hull_sizes(arena)
    assert sorted(made[before:]) == hulls  # a buffer per wave, each taken once
    assert arena.fallbacks == arena.divergences == 0 and device.races == []


@pytest.mark.parametrize("policy", list(POLICIES))
def test_peak_device_memory_is_at_most_the_unplanned_runs(policy, nvme_dir):
    """Against the same training with the planner off (a new tensor per request, as PyTorch
    allocates): the arena adds nothing to the device peak (Note [a buffer per wave]). A buffer
    per run held `tokenwise` 0.97% over (its rebuilt tensors die one by one, the buffer stayed
    to the last); held through forward too, the one buffer of the first design was 15-47% over."""
    peaks = {}
    for planner_setting in ("off", "greedy"):
        actoff.reset()
        model = _offloaded(POLICIES[policy], nvme_dir, planner=planner_setting)
        with simulated_device(seed=14) as device:
            _steps(model, device, [33] * 2)
            device.memory.reset_peak()
            _steps(model, device, [33] * 3)
            peaks[planner_setting] = device.memory.peak
        arena_bytes = actoff.stats().device_arena_bytes
    assert arena_bytes > 0
    assert peaks["greedy"] <= peaks["off"], peaks


def test_a_new_length_is_planned_from_its_first_step_and_a_known_one_reuses_its_plan(monkeypatch):
    solves = []
    real_solve = planner.solve_bilevel
    monkeypatch.setattr(
        "actoff.memory.arenas.solve_bilevel",
        lambda *args, **kwargs: solves.append(1) or real_solve(*args, **kwargs),
    )
    model = _offloaded(POLICIES["cpu"])
    with simulated_device(seed=15) as device:
        short = _steps(model, device, [33, 33])
        arena = _arena()
        short_plan, short_size = dict(arena.plan), arena.size
        long = _steps(model, device, [65, 65])
        long_size = arena.size
        back = _steps(model, device, [33, 33])
    assert short[1][0] == short[1][1] and not short[1][2]
    assert long[0][2] > 0  # another length: its requests diverge ...
    assert long[1][0] == long[1][1] and not long[1][2]  # ... and that step is the next plan
    # A length seen before is served by its plan kept from its first request (Note [a plan per shape]).
    assert back[0][0] == back[0][1] > 0 and not back[0][2] and not back[1][2]
    assert arena.plan == short_plan  # the short plan again ...
    assert len(solves) == 2 and len(_device_plans()) == 2  # ... from memory, not solved again
    # Each step takes buffers of its own plan's sizes: the short length's again at the end.
    assert long_size > short_size and arena.size == short_size
    assert arena.num_allocations <= 5 * len(arena.parts)  # a buffer per part and step at most
    assert device.races == []


@pytest.mark.parametrize("shapes", ["lengths", "models"])
def test_shapes_in_turns_are_each_served_by_their_own_plan(shapes, monkeypatch):
    """(Note [a plan per shape]) two lengths (or two models of one family, with the same layer
    names) in turns. With one plan in force, every step diverged and nothing was served."""
    made = _device_allocations(monkeypatch)
    if shapes == "lengths":
        lengths, plain, offloaded = [33, 65] * 4, make_model(), _offloaded(POLICIES["cpu"])
    else:
        lengths = [33] * 8
        plain = [make_model(), make_model(seed=1, hidden_size=96, intermediate_size=256)]
        offloaded = [make_model(), make_model(seed=1, hidden_size=96, intermediate_size=256)]
        for model in offloaded:
            actoff.offload_(model, block_cls=Block, min_bytes=0, policy="cpu")
    expected, actual = [], []
    with simulated_device(seed=21) as device:
        _steps(plain, device, lengths, expected)
        figures = _steps(offloaded, device, lengths, actual)
    assert_same_history(expected, actual)
    arena = _arena()
    for requests, served, divergences, fallbacks in figures[2:]:  # each shape planned once
        assert requests == served > 0 and divergences == fallbacks == 0
    assert len(arena.plans) == 2 and len(_device_plans()) == 2
    assert device.races == [] and made


def test_the_least_recently_used_plan_goes_past_the_limit(monkeypatch):
    monkeypatch.setattr("actoff.memory.device_plans.KEPT", 2)
    model = _offloaded(POLICIES["cpu"])
    with simulated_device(seed=22) as device:
        figures = _steps(model, device, [33, 41, 49, 41, 33])
    assert len(_arena().plans) == 2
    assert figures[3][1] == figures[3][0] and not figures[3][2]  # 41 still kept
    assert figures[4][2] > 0  # 33 was the least recently used: it diverges again


def test_plans_come_back_from_the_disk_cache(tmp_path):
    for attempt in range(2):
        actoff.reset()
        model = _offloaded(POLICIES["cpu"], plan_cache=str(tmp_path))
        with simulated_device(seed=16) as device:
            _steps(model, device, [33] * 2)
        method = actoff.stats().device_plan
        assert method == "cache" if attempt else method not in ("cache", "none")


@pytest.mark.parametrize("from_env", [False, True], ids=["argument", "environment"])
def test_planner_off_allocates_per_request_as_before(from_env, monkeypatch):
    made = _device_allocations(monkeypatch)
    if from_env:
        monkeypatch.setenv("ACTOFF_PLANNER", "off")
        actoff.set_config()
    model = _offloaded(POLICIES["cpu"], **({} if from_env else {"planner": "off"}))
    per_step = []
    with simulated_device(seed=17) as device:
        for _ in range(3):
            before = len(made)
            _steps(model, device, [33])
            per_step.append(len(made) - before)
    assert get_runtime().arenas.on_device == {}
    assert per_step[0] == per_step[1] == per_step[2] > 0  # a new tensor for every request, every step
    stats = actoff.stats()
    assert stats.device_plan == "none" and stats.device_arena_bytes == 0
    assert "device arena" not in str(stats)


def test_stats_report_the_arena_against_its_lower_bound():
    model = _offloaded(POLICIES["tokenwise"])
    with simulated_device(seed=18) as device:
        _steps(model, device, [33] * 3)
    stats, arena = actoff.stats(), _arena()
    assert stats.device_arena_bytes == arena.size > 0  # the most its buffers held at once
    assert stats.device_plan_bytes == arena.layout.peak >= stats.device_lower_bound > 0
    assert stats.device_allocations == arena.num_allocations > 0
    assert stats.device_solve_s >= 0 and stats.device_plan == arena.layout.method
    # The first token-wise step stores whole (the probe runs in its backward): its own plan.
    assert stats.device_plans == len(arena.plans) >= 1
    text = str(stats)
    assert "device arena:" in text and "lower bound" in text and f"{len(arena.plans)} layout(s) kept" in text


# ---------------------------------------------------------------------- the arena alone
@pytest.fixture
def arena():
    streams = SimStreams(SimSettings(seed=19))
    yield DeviceArena(StreamBackend(torch.device("cpu"), streams))
    streams.close()


def test_a_tenant_alive_does_not_keep_its_arena_alive():
    """A tenant's death is queued by a finalizer; through a bound method it held the arena, so a
    graph kept after `actoff.reset()` kept the arena, its plan and its backend (found in review)."""
    import gc

    streams = SimStreams(SimSettings(seed=20))
    arena = DeviceArena(StreamBackend(torch.device("cpu"), streams))
    tenant = arena.empty(256, torch.float32, (0, "fetch", 0), tag=0)
    gone = weakref.ref(arena)
    del arena
    gc.collect()
    assert gone() is None and tenant.numel() == 256
    del tenant
    streams.close()


def _plan(arena: DeviceArena, *requests) -> None:
    """Trace ``requests`` ((key, elements, alive-with-the-next)) as one step and install its plan."""
    held = []
    for key, numel, overlaps_next in requests:
        tensor = arena.empty(numel, torch.float32, key, tag=0)
        held = [tensor] if overlaps_next else []
        del tensor
    del held
    trace = arena.take_trace()
    layout = planner.solve([planner.Buffer(*entry[:3]) for entry in trace], alignment=512)
    arena.install_plan(DevicePlan([entry[3] for entry in trace], [entry[0] for entry in trace], layout))
    arena.begin_step()


def test_a_planned_range_still_held_is_never_handed_out_twice(arena):
    _plan(arena, ((0, "fetch", 0), 256, False), ((0, "fetch", 1), 256, False))
    assert arena.plan[(0, "fetch", 0, 0)][1] == arena.plan[(0, "fetch", 1, 0)][1]  # one range, in turn
    first = arena.empty(256, torch.float32, (0, "fetch", 0), tag=0).fill_(1.0)
    second = arena.empty(256, torch.float32, (0, "fetch", 1), tag=0).fill_(2.0)  # first still alive
    assert arena.served == 1 and arena.fallbacks == 1 and arena.divergences == 0
    assert second.data_ptr() != first.data_ptr() and bool((first == 1.0).all())
    del first, second
    arena.begin_step()
    held = arena.empty(256, torch.float32, (0, "fetch", 0), tag=0)
    arena.empty(256, torch.float32, (0, "fetch", 1), tag=0)
    assert arena.fallbacks == 1 and arena.wants_plan()  # two steps in a row: planned again
    del held


def test_an_unknown_request_diverges_and_an_expected_one_falls_back(arena):
    _plan(arena, ((0, "fetch", 0), 256, False))
    arena.expect((1, "fetch", 0))  # served from the device this step
    arena.begin_step()
    arena.empty(512, torch.float32, (0, "fetch", 0), tag=0)  # another size
    assert (arena.divergences, arena.fallbacks) == (1, 0) and arena.wants_plan()
    arena.begin_step()
    arena.empty(256, torch.float32, (1, "fetch", 0), tag=1)  # fetched after all
    assert (arena.divergences, arena.fallbacks) == (0, 1) and not arena.wants_plan()


def test_a_part_is_let_go_at_its_last_request_and_goes_with_its_last_tenant(arena):
    """(Note [a buffer per wave]) the arena lets a part's buffer go once the part's planned
    requests were all made (its tenants keep it, and it goes when the last of them dies); a run
    served partly from the device this step (a planned request that does not come) lets its
    buffers go when its records are released (`run_done`)."""
    _plan(
        arena,
        ((0, "fetch", 0), 256, True),
        ((0, "fetch", 1), 256, False),
        ((1, "fetch", 0), 256, False),
    )
    assert set(arena.parts) == {(0, "fetch"), (1, "fetch")}
    first = arena.empty(256, torch.float32, (0, "fetch", 0), tag=0)
    assert set(arena.buffers) == {(0, "fetch")}  # a request of its part still to come
    second = arena.empty(256, torch.float32, (0, "fetch", 1), tag=0)
    other = arena.empty(256, torch.float32, (1, "fetch", 0), tag=1)
    assert arena.served == 3 and arena.num_allocations == 2
    assert arena.buffers == {} and arena.capacity == 2048 + 1024  # let go, kept by the tenants
    del first
    arena.empty(8, torch.float32, (2, "fetch", 0), tag=2).zero_()  # any call handles the deaths
    assert arena.capacity == 2048 + 1024  # a tenant of run 0's buffer is alive
    del second
    arena.empty(8, torch.float32, (2, "fetch", 0), tag=2).zero_()
    assert arena.capacity == 1024  # run 0's buffer went with its last tenant
    arena.begin_step()
    first = arena.empty(256, torch.float32, (0, "fetch", 0), tag=0)  # (0, "fetch", 1) never comes
    del first
    arena.empty(8, torch.float32, (2, "fetch", 0), tag=2).zero_()
    assert set(arena.buffers) == {(0, "fetch")}  # a planned request still to come: held
    arena.run_done(1)  # another run: nothing of run 0's goes
    assert set(arena.buffers) == {(0, "fetch")}
    arena.run_done(0)
    assert arena.buffers == {} and arena.capacity == 1024  # the last step's `other` lives on
    del other
    arena.empty(8, torch.float32, (2, "fetch", 0), tag=2).zero_()
    assert arena.capacity == 0


def test_a_step_that_skips_its_last_requests_takes_a_buffer_of_what_it_makes(arena):
    """(Note [skipped requests]) requests live at once are stacked as they came; a step that
    `expect`s the last ones (records served from the device) takes a buffer of the others' range
    only, serves them as planned and gives it back when they die."""
    keys = [(0, "fetch", index) for index in range(3)]
    held = [arena.empty(256 * (index + 1), torch.float32, key, tag=0) for index, key in enumerate(keys)]
    del held
    trace = arena.take_trace()
    layout = planner.solve([planner.Buffer(*entry[:3]) for entry in trace], alignment=512)
    assert layout.offsets == (0, 1024, 3072) and layout.peak == 6144  # in request order
    arena.install_plan(DevicePlan([entry[3] for entry in trace], [entry[0] for entry in trace], layout))
    arena.begin_step()
    arena.expect(keys[2])  # still on the device this step: served from there
    first = arena.empty(256, torch.float32, keys[0], tag=0).fill_(1.0)
    second = arena.empty(512, torch.float32, keys[1], tag=0).fill_(2.0)
    assert (arena.served, arena.fallbacks, arena.divergences) == (2, 0, 0)
    assert arena.capacity == 3072  # not the hull's 6144
    assert bool((first == 1.0).all()) and bool((second == 2.0).all())
    del first, second
    arena.empty(8, torch.float32, (1, "fetch", 0), tag=1).zero_()  # any call handles the deaths
    assert (0, "fetch") not in arena.buffers  # what this step makes was made and died: given back
    arena.begin_step()  # a step that fetches all three takes the whole hull
    tensors = [arena.empty(256 * (index + 1), torch.float32, key, tag=0) for index, key in enumerate(keys)]
    assert arena.served == 3 and arena.capacity == 6144
    del tensors


def test_a_run_partly_served_from_the_device_takes_a_buffer_of_what_it_fetches(monkeypatch):
    """Note [skipped requests], end to end: a step where the last block's later records are still
    being copied out at backward (served from the device) takes a shorter buffer for that run
    than the step planned, where all were fetched, with no fallback, and trains exactly."""
    taken = []
    real_buffer = DeviceArena._buffer

    def taking(self, part):
        before = self.buffers.get(part)
        held = real_buffer(self, part)
        if held is not None and held is not before:
            taken.append((part[0], held.buffer.numel()))
        return held

    monkeypatch.setattr(DeviceArena, "_buffer", taking)
    steps = 4
    expected = train(make_model(num_layers=3), steps)
    model = make_model(num_layers=3)
    actoff.offload_(model, block_cls=Block, min_bytes=0, policy="cpu", keep_last=0)
    last = len(model.layers) - 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    actual, figures = [], []
    with simulated_device(seed=5) as device:
        for step in range(steps):
            tokens = torch.randint(0, 256, (2, 33), generator=generator)
            device.drain()
            with device.hold(copies=True):
                loss = model.loss(tokens)
            runtime = get_runtime()
            with runtime.lock:  # the copies out of the first records (all, while tracing and planning) end
                records = runtime.step.runs[last].records
                for record in records[: len(records) if step < 2 else len(records) // 2]:
                    record.tier.advance(record, force=True)
            before = len(taken)
            loss.backward()
            arena = _arena()
            figures.append((arena.served, arena.requests, arena.fallbacks, arena.divergences, taken[before:]))
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
            actual.append((loss.detach().clone(), grads))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert_same_history(expected, actual)

    def taken_for_last(buffers):  # bytes of the buffers taken for the last block's waves
        return sum(size for run, size in buffers if run == last)

    whole = taken_for_last(figures[1][4])  # the planned step: every record of the block fetched
    for served, requests, fallbacks, divergences, buffers in figures[2:]:
        assert served == requests > 0 and fallbacks == divergences == 0
        assert 0 < taken_for_last(buffers) < whole
    assert actoff.stats().blocks[f"layers.{last}"].forwarded > 0
    assert device.races == []


def test_a_request_off_the_plan_gets_a_tensor_of_its_own_and_the_wave_goes_without_it(arena):
    """A request the plan does not know, made while a part's buffer waits for its last request,
    is a new allocation: in the buffer's free range it would take the bytes planned for that
    request (a fallback more) and keep the whole buffer alive past its wave (found in review)."""
    _plan(arena, ((0, "fetch", 0), 16384, True), ((0, "fetch", 1), 16384, False))
    first = arena.empty(16384, torch.float32, (0, "fetch", 0), tag=0)
    stranger = arena.empty(256, torch.float32, (0, "fetch", 7), tag=0)  # not in the plan
    second = arena.empty(16384, torch.float32, (0, "fetch", 1), tag=0)
    assert (arena.served, arena.divergences, arena.fallbacks) == (2, 1, 0)
    assert arena.capacity == 2 * 65536 and arena.num_allocations == 1
    del first, second
    arena.empty(8, torch.float32, (2, "fetch", 0), tag=2).zero_()  # any call handles the deaths
    assert arena.capacity == 0  # the buffer went with its wave; the stranger is not in it
    del stranger


def test_a_new_plan_never_serves_a_range_of_a_buffer_cut_to_the_old_one(arena):
    """A buffer still held when a new plan comes (a step whose backward is not the current one:
    gradient accumulation, two forwards before their backwards) was cut to the old plan's hull:
    the new plan's offsets do not fit it. Served there, a request got bytes counted back from
    the buffer's end, where a live tenant was (found in review: a silently wrong gradient)."""
    keys = [(0, "fetch", 0, 0), (0, "fetch", 1, 0)]
    arena.install_plan(
        DevicePlan(keys, [1024, 1024], planner.Layout((2048, 3072), 4096, 2048, "test", False))
    )
    arena.begin_step()
    first = arena.empty(256, torch.float32, (0, "fetch", 0), tag=0).fill_(1.0)  # its buffer: [2048, 4096)
    arena.install_plan(DevicePlan(keys, [1024, 1024], planner.Layout((0, 1024), 2048, 2048, "test", True)))
    second = arena.empty(256, torch.float32, (0, "fetch", 1), tag=0).fill_(2.0)
    assert second.numel() == 256
    low, high = first.data_ptr(), first.data_ptr() + 1024
    assert second.data_ptr() + 1024 <= low or high <= second.data_ptr()
    assert bool((first == 1.0).all()) and bool((second == 2.0).all())


def test_a_request_both_plans_know_does_not_keep_the_wrong_one(arena):
    """(Note [a plan per shape]) two models of one width share some requests (a norm's statistics);
    a step of the second starting with one of them still picks its own plan at its first request
    the first plan does not know, and every request is served."""
    shared, own = ((1, "fetch", 0), 128, False), (1, "fetch", 1)
    _plan(arena, shared, (own, 256, False))  # model A
    _plan(arena, shared, (own, 512, False))  # model B, now in force
    for numel in (256, 512, 256):  # A, B, A in turns
        first = arena.empty(128, torch.float32, shared[0], tag=1)
        second = arena.empty(numel, torch.float32, own, tag=1)
        assert (arena.requests, arena.served, arena.divergences, arena.fallbacks) == (2, 2, 0, 0)
        assert arena.plan[(*own, 0)][0] == numel * 4
        del first, second
        arena.begin_step()
    assert len(arena.plans) == 2


def test_one_shape_keeps_one_plan_and_a_record_fetched_once_more_is_a_fallback(arena):
    """Found in review: a replan after fallbacks traced fewer fetches (more records served from
    the device), so it was kept beside the plan of the same shape; a later step fetching one
    record more switched plans mid-step and took a second buffer for requests already made."""
    keys = [(0, "fetch", index) for index in range(8)]

    def one_wave(fetched):
        held = [arena.empty(256, torch.float32, key, tag=0) for key in fetched]  # alive at once
        del held

    one_wave(keys)
    trace = arena.take_trace()
    layout = planner.solve([planner.Buffer(*entry[:3]) for entry in trace], alignment=512)
    arena.install_plan(DevicePlan([entry[3] for entry in trace], [entry[0] for entry in trace], layout))
    arena.begin_step()
    for key in keys[4:]:  # half the records still on the device at backward
        arena.expect(key)
    one_wave(keys[:4])
    trace = arena.take_trace()  # as the layout does after fallbacks: the step is planned again
    layout = planner.solve([planner.Buffer(*entry[:3]) for entry in trace], alignment=512)
    arena.install_plan(DevicePlan([entry[3] for entry in trace], [entry[0] for entry in trace], layout))
    assert len(arena.plans) == 1  # the same shape: the plan in force was replaced
    arena.begin_step()
    for key in keys[5:]:
        arena.expect(key)
    alive = [arena.empty(256, torch.float32, key, tag=0) for key in keys[:5]]
    assert (arena.served, arena.fallbacks, arena.divergences) == (4, 1, 0)
    assert arena.capacity == 4 * 1024 and arena.num_allocations == 2  # one buffer per plan's step
    del alive
