"""The auto policy's plans (actoff.runtime.planning): what keeps a plan in force against a replan
on time alone (Note [a plan kept against time noise]). Pure numbers: the costs and plans are
built here, predicted by the model of actoff.budget."""

from actoff.budget import BlockCost, Outside, Placement, Plan, Windows, moments
from actoff.runtime.planning import StepPlan, fit
from actoff.runtime.trials import still_good
from actoff.step_time import predict

# Two blocks: 10 ms forwards, 2 ms of attention, 5 MB saved each; a 1 GB/s link.
COSTS = (BlockCost(0.010, 0.002, 10**6, 10**6, 3 * 10**6),) * 2
LINK = 1e9


NONE = Windows()
NOTHING = Outside()


def _again(placements, windows=NONE, budget=10**8, outside=NOTHING) -> StepPlan:
    """A replan's step plan: ``placements`` as fitting would have chosen them, predicted here."""
    peak, seconds = predict(COSTS, placements, LINK, outside_bytes=outside, windows=windows)
    plan = Plan(tuple(placements), windows, peak, seconds)
    return StepPlan((), ("a", "b"), (), plan, COSTS, budget, LINK, outside, "replanned: time", True)


def test_a_plan_within_the_tolerance_of_the_new_one_stays_with_its_predictions_renewed():
    # The new plan keeps both blocks: 20 ms of forwards, nothing added. The plan in force
    # streams both with a 5 MB copy window (every copy out hidden behind 10 ms of compute) and a
    # fetch window of 1.1 MB: 4.4 ms of backward compute hides 5 ms of fetch, 0.6 ms exposed a
    # block: 21.2 ms, 6% over, inside the 10%. At 0.9 MB: 1.4 ms a block, 22.8 ms, 14% over.
    again = _again([Placement("keep")] * 2)
    near = Plan((Placement("stream"),) * 2, Windows(1.1e6, 5e6), 0.0, 0.0)
    kept = still_good(near, again)
    assert kept is not None and (kept.placements, kept.windows) == (near.placements, near.windows)
    assert (kept.peak_bytes, kept.seconds) == predict(COSTS, near.placements, LINK, windows=near.windows)
    assert abs(kept.seconds - 0.0012) < 1e-9
    assert still_good(Plan(near.placements, Windows(0.9e6, 5e6), 0.0, 0.0), again) is None


def test_a_plan_more_than_the_tolerance_slower_gives_way():
    # Windows of none expose each block's copies: 5 ms out and 5 ms back a block, 20 ms over
    # the new plan's 20 ms: 2x.
    again = _again([Placement("keep")] * 2)
    assert still_good(Plan((Placement("stream"),) * 2, Windows(), 0.0, 0.0), again) is None
    # Checkpointing one block re-runs its 10 ms forward (and copies its input): 1.5x and more.
    assert still_good(Plan((Placement("checkpoint"), Placement("keep")), Windows(), 0.0, 0.0), again) is None


def test_a_plan_that_no_longer_fits_the_budget_gives_way_however_fast():
    # Keep predicts 10 MB of saves over 90 MB outside the blocks: over 97% of a 100 MB budget.
    again = _again([Placement("stream")] * 2, Windows(5 * 10**6, 5 * 10**6), outside=Outside.flat(9 * 10**7))
    assert still_good(Plan((Placement("keep"),) * 2, Windows(), 0.0, 0.0), again) is None
    assert still_good(again.plan, again) is not None  # the new plan itself passes its own test


def test_a_trial_whose_runner_up_is_refused_in_chunks_gives_the_plan_in_force_back():
    """(Note [a plan tried against its runner-up]) A length's plan is under trial, its runner-up
    in force, when another length's failed probe refuses that plan's chunked block: the trial
    ends with the plan it challenged back in force, calibrated as it was, not a plan made again
    from a first plan's headroom (a review's reproducer: the runner-up had been applied again)."""
    import types

    import torch

    from actoff.config import Config
    from actoff.runtime.measured import Measured
    from actoff.runtime.planning import AutoPlans, _leave_refused_chunks
    from actoff.runtime.trials import Trial

    def entry(name: str) -> Measured:
        return Measured(
            name,
            5,
            input_bytes=2**20,
            attention_bytes=2**20,
            local_bytes=8 * 2**20,
            forward_s=0.01,
            tokenwise=True,
            probed=True,
            chunk_refusal="",
            kv_bytes=2**19,
            node_bytes=2**20,
            chunk_tokens=1024,
            tokens=4096,
            numel=4096 * 64,
        )

    owner, entries = torch.nn.Linear(1, 1), (entry("b0"), entry("b1"))
    incumbent = Plan((Placement("stream"), Placement("stream")), Windows(), 30 * 2**20, 0.004)
    challenger = Plan((Placement("chunked"), Placement("stream")), Windows(), 25 * 2**20, 0.005)
    costs = tuple(e.cost() for e in entries)
    other = StepPlan(
        ("K2",), ("b0", "b1"), entries, challenger, costs, 64 * 2**20, 1e9, Outside(), "calibrated", True
    )
    other.candidates = (incumbent, challenger)
    other.trial = Trial(
        incumbent, challenger, incumbent_s=[0.1, 0.1], challenger_s=[0.09], running=challenger
    )
    plans = AutoPlans()
    plans.plans.setdefault(owner, dict)[("K2",)] = plans.current = other
    entries[0].chunk_refusal = "its probe failed at another length"
    state = types.SimpleNamespace(
        key=types.SimpleNamespace(owner=owner), run=types.SimpleNamespace(config=Config())
    )
    _leave_refused_chunks(plans, types.SimpleNamespace(states=[state], keys=("K1",), entries=()))
    after = plans.plans.get(owner)[("K2",)]
    assert after is other and after.plan == incumbent and after.calibrated and after.trial is None
    assert after.candidates == (incumbent,) and plans.replans == 0
    assert [str(p) for e in entries for p in e.placements] == ["stream", "stream"]


def test_a_calibrated_plan_with_wider_windows_than_its_step_fits_with_those_windows_full():
    """(Note [windows the step did not run] in actoff.budget) The main run's floor at 1024 tokens
    (4 blocks and the head and loss, auto under 59.62 MiB, a 204 MB/s link): its step under 5.26
    MiB windows, streaming everything, peaked with nothing in flight, so the memory outside read
    5.26 MiB low. Calibrated on it, auto chose a 42.1 MiB copy window predicted at 54.4 MiB;
    its forward, a block behind the link, peaked at 59 to 61 MiB and the capped device ran out
    of memory (in 1 run of 4). Held to the seen windows' bytes, the plan it chooses fits the
    budget under the outside as it was, with its windows full."""
    block = BlockCost(
        0.06, 0.016, 1310720, 3178496, 17571840, tokenwise=False, kv_bytes=2**20, node_bytes=6 * 2**20
    )
    costs = (block,) * 4 + (BlockCost(0.015, 0.0, 1056768, 0, 6303748, tokenwise=False),)
    seen, budget = Windows(5515264, 5515264), 62521344
    outside = Outside(34980864.0, 32560640.0, 41403904.0)  # from the step's peaks, seen full
    real = Outside(outside.forward + seen.copy, outside.head + seen.copy, outside.backward + seen.fetch)
    chosen, at_floor, _ = fit(costs, 204.5e6, budget, outside, calibrated=True, seen=seen)
    assert not at_floor and chosen.peak_bytes <= budget * 0.97
    assert max(moments(costs, chosen.placements, real, chosen.windows)) <= budget, chosen.describe()
    blind, _, _ = fit(costs, 204.5e6, budget, outside, calibrated=True)  # as before: seen not known
    assert max(moments(costs, blind.placements, real, blind.windows)) > budget, blind.describe()
