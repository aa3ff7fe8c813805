"""Sentinel rows (Note [sentinel rows], actoff/tiers/tokenwise/sentinels.py): token-wise recompute checked every
step against a few rows kept at forward time, so a block whose probe was fooled (a scan over
tokens behind a gate that was zero then) is caught before a wrong row is used."""

import copy
import warnings

import pytest
import torch
from _helpers import assert_close_history, make_model, train
from torch import nn

import actoff
from actoff.reference import Block
from actoff.runtime.runtime import get_runtime


class GatedScanBlock(Block):
    """A cumulative sum over tokens, outside any token mixer, through a gate that starts at zero
    (as gates and adapters often do): at step 0 it adds nothing, so its probe matches."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.gate = nn.Parameter(torch.zeros(config.hidden_size))

    def forward(self, x, cos, sin):
        return super().forward(x + torch.cumsum(x * self.gate, dim=1), cos, sin)


class ScaledBlock(Block):
    """A block whose output depends on state the user may change between forward and backward."""

    scale = 1.0

    def forward(self, x, cos, sin):
        return super().forward(x * ScaledBlock.scale, cos, sin)


def _model(block_cls) -> nn.Module:
    model = make_model()
    torch.manual_seed(1)
    model.layers = nn.ModuleList(block_cls(model.config) for _ in model.layers)
    return model


def _recompute_bytes() -> int:
    return sum(block.bytes_per_tier["recompute"] for block in actoff.stats().blocks.values())


@pytest.mark.parametrize("policy", ["tokenwise", "recompute"])
def test_a_scan_behind_a_zero_gate_is_caught_and_its_rows_recomputed_from_the_first_token(policy):
    """Without sentinels, step 1's gradients were wrong (the rows missed the scan's prefix) and
    nothing was said. ``recompute`` re-runs every token: nothing is missing, nothing to catch."""
    model = _model(GatedScanBlock)
    expected = train(copy.deepcopy(model), 3)
    fractions = {"cpu_fraction": 0.5} if policy == "tokenwise" else {}  # read by tokenwise only
    actoff.offload_(model, block_cls=GatedScanBlock, policy=policy, min_bytes=0, **fractions)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = train(model, 3)
    assert_close_history(expected, actual)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if policy == "recompute":
        assert messages == [] and _recompute_bytes() > 0
    else:
        assert len(messages) == len(model.layers)  # once per block, at step 1
        assert all("differed from the forward's though its first step's probe matched" in m for m in messages)
        assert _recompute_bytes() == 0  # placed whole from then on


def test_a_block_changed_before_backward_is_an_error_without_verify():
    """The rows recomputed from the first token differ too: the block computes something else in
    backward. Training must not go on with that activation, and ACTOFF_VERIFY is off."""
    model = _model(ScaledBlock)
    actoff.offload_(model, block_cls=ScaledBlock, policy="tokenwise", cpu_fraction=0.5, min_bytes=0)
    tokens = torch.randint(0, 256, (2, 33))
    model.loss(tokens).backward()  # first step: the probe passes
    loss = model.loss(tokens)
    ScaledBlock.scale = 1.5
    try:
        with pytest.raises(RuntimeError, match="even recomputed from the first token"):
            loss.backward()
    finally:
        ScaledBlock.scale = 1.0


def test_three_rows_per_split_record_are_kept_and_go_with_backward():
    model = make_model()
    actoff.offload_(model, block_cls=Block, policy="tokenwise", cpu_fraction=0.5, min_bytes=0)
    train(model, 1)  # the probe's step
    loss = model.loss(torch.randint(0, 256, (2, 33)))
    runs = [split for split in _splits() if split.records]
    assert runs
    for tokenwise in runs:
        assert len(tokenwise.checks) == len(tokenwise.records)
        for (index, picked, kept), record in zip(tokenwise.checks, tokenwise.records, strict=True):
            start, stop = tokenwise.ranges.recompute
            assert index == record.index and picked == (0, 1, stop - start - 1)
            assert kept.shape[record.canon.dim] == 3
    loss.backward()
    assert all(split.checks == [] for split in runs)


def test_two_forwards_before_one_backward_warn_once_per_block_and_keep_only_the_rows_needed(monkeypatch):
    """Found in review: runs of a block still waiting for backward when the first is caught each
    warned again; the re-run from the first token kept every record at full length."""
    from actoff.tiers.tokenwise import slices as reforward

    recovered = []
    real_recompute = reforward.recompute

    def spy(tokenwise, start, stop, **kwargs):
        rows = real_recompute(tokenwise, start, stop, **kwargs)
        if kwargs.get("keep_from"):
            recovered.extend(rows.values())
        return rows

    monkeypatch.setattr(reforward, "recompute", spy)
    model = _model(GatedScanBlock)
    reference = copy.deepcopy(model)
    actoff.offload_(model, block_cls=GatedScanBlock, policy="tokenwise", cpu_fraction=0.5, min_bytes=0)
    train(model, 1)  # the probe's step: the gate is zero, then trained
    train(reference, 1)
    reference_loss = sum(reference.loss(torch.randint(0, 256, (2, 33), generator=g)) for g in _two())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = sum(model.loss(torch.randint(0, 256, (2, 33), generator=g)) for g in _two())
        loss.backward()
    assert [str(w.message).split("'")[1] for w in caught] == ["layers.1", "layers.0"]
    reference_loss.backward()
    for (name, actual), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert recovered and all(
        rows.untyped_storage().nbytes() == rows.numel() * rows.element_size() for rows in recovered
    )


def _splits():
    """The token-wise state of the current step's runs that split (or may split) by token."""
    runs = get_runtime().step.runs
    return [run.placement.split for run in runs if getattr(run.placement, "active", False)]


def _two():
    return [torch.Generator().manual_seed(seed) for seed in (5, 6)]


@pytest.mark.parametrize("half", ["autocast", "weights"])
def test_a_block_in_half_precision_is_compared_within_a_half_precision_rounding(half):
    """A float32 save computed from bf16 values (a norm's statistics) may be one bf16 rounding off
    when a kernel picks another order for fewer rows (on a GPU): not a token mixed."""
    model = make_model()
    if half == "weights":
        model = model.to(torch.bfloat16)
    actoff.offload_(model, block_cls=Block, policy="tokenwise", cpu_fraction=0.5, min_bytes=0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half == "autocast"):
        model.loss(torch.randint(0, 256, (2, 33))).backward()  # the probe's step
        loss = model.loss(torch.randint(0, 256, (2, 33)))
    runs = [split for split in _splits() if split.records]
    assert runs and all(split.half_precision for split in runs)
    loss.backward()
    actoff.reset()
    plain = make_model()  # float32, no autocast
    actoff.offload_(plain, block_cls=Block, policy="tokenwise", cpu_fraction=0.5, min_bytes=0)
    plain.loss(torch.randint(0, 256, (2, 33)))
    runs = _splits()
    assert runs and not any(split.half_precision for split in runs)


class LengthBranchBlock(Block):
    """Control flow on the length: a multiple of 8 takes one path, other lengths save one more
    tensor. At 32 tokens the forward and the probe's re-run on 24 take the same path; at 40 the
    forward saves as at 32 (its probe serves it: Note [a probe serves other lengths]) while the
    re-run on 30 tokens takes the other path."""

    def forward(self, x, cos, sin):
        if x.shape[1] % 8:
            x = x + torch.tanh(x) * 1e-3
        return super().forward(x, cos, sin)


def test_a_probe_of_another_length_that_does_not_fit_is_recomputed_from_the_first_token():
    """The re-run on the slice saves more tensors than the forward did: the rows come from a
    re-run from the first token (the forward itself, exact), one warning, and the block is
    placed whole at that length from then on (it raised ReforwardMismatch in backward)."""
    model = _model(LengthBranchBlock)
    reference = copy.deepcopy(model)
    expected = [train(reference, 1, seq=seq)[0] for seq in (33, 41, 41)]
    actoff.offload_(model, block_cls=LengthBranchBlock, policy="tokenwise", cpu_fraction=0.25, min_bytes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = [train(model, 1, seq=seq)[0] for seq in (33, 41, 41)]
    assert_close_history(expected, actual)
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2 and "did not save what the forward saved" in messages[0], messages
    assert "'layers.0'" in messages[0] and "recomputed them from the first token" in messages[0]
    assert _recompute_bytes() == 0  # the third step: placed whole at 40 tokens
