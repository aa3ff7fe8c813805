"""Token-wise recompute as clients use it: a new length every step, frozen base weights with
low-rank adapters (LoRA), autocast, several models with the same layer names in one process.

Tolerances: on CPU the re-forward runs the same kernels on fewer rows, so float32 results
are expected within ``RECOMPUTE_TOL`` (float32 reassociation, as in test_tokenwise.py).
Under bf16 autocast the block output is rounded to bf16 (8 bits of mantissa) in both runs;
the recomputed rows are rounded the same way, but a GEMM on fewer rows may sum in another
order before that rounding, so one bf16 ulp of the largest values is allowed: ``BF16_TOL``.
"""

import gc
import os
import warnings

import pytest
import torch
from _helpers import make_model

import actoff
from actoff._record import Record
from actoff._step import ScopeRun, Step
from actoff._tokenwise import TokenwiseRun
from actoff.reference import Block

RECOMPUTE_TOL = {"rtol": 1e-5, "atol": 1e-6}
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-3}


def _live_actoff_objects() -> int:
    gc.collect()
    kinds = (Step, ScopeRun, Record, TokenwiseRun)
    # type(), not isinstance: isinstance reads __class__, which warns on some torch objects.
    return sum(type(o) in kinds for o in gc.get_objects())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------- lengths
@pytest.mark.parametrize(
    "overrides",
    [
        {"policy": "tokenwise", "cpu_fraction": 0.25},
        {"policy": "recompute"},
        {"policy": "auto", "host_bandwidth": "20MB"},
    ],
    ids=["tokenwise", "recompute", "auto"],
)
def test_a_new_length_every_step_leaks_nothing(overrides):
    # Every step probes (a new sequence length): the probe must keep nothing of the
    # re-forward's graph (Note [probe keeps no graph]), or each step leaks its whole state.
    model = make_model()
    actoff.offload_(model, block_cls=Block, min_bytes=0, **overrides)
    generator = torch.Generator().manual_seed(0)
    samples = {}
    for step in range(110):
        length = 20 + step  # never the head size (16): see the README on ambiguous inputs
        tokens = torch.randint(0, 256, (2, length + 1), generator=generator)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every length is recomputed, none falls back
            model.loss(tokens).backward()
        model.zero_grad(set_to_none=True)
        if step in (10, 109):
            samples[step] = (_live_actoff_objects(), _rss_bytes(), len(os.listdir("/proc/self/fd")))
    assert actoff.stats().blocks["layers.0"].bytes_per_tier["recompute"] > 0
    (objects_before, rss_before, fds_before), (objects_after, rss_after, fds_after) = (
        samples[10],
        samples[109],
    )
    assert objects_after == objects_before, (objects_before, objects_after)  # one step's worth
    assert fds_after == fds_before
    assert rss_after - rss_before < 24 * 2**20, (rss_before, rss_after)  # allocator noise, not a leak
    actoff.reset()
    assert _live_actoff_objects() == 0
