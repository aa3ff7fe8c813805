"""Records: the checked state machine and exact rebuild of any strided view."""

import pytest
import torch

from actoff.tiers.record import Record, RecordStateError, State, TensorGeometry


class _Run:
    name = "block"


def test_allowed_path_through_the_state_machine():
    record = Record(torch.randn(4), _Run(), 0)
    for state in (
        State.OFFLOADING,
        State.OFFLOADED,
        State.FETCHING,
        State.READY,
        State.OFFLOADED,
        State.RELEASED,
    ):
        record.to(state)
    assert record.state is State.RELEASED


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ((), State.READY),
        ((), State.FETCHING),
        ((State.OFFLOADING,), State.READY),
        ((State.OFFLOADING, State.OFFLOADED), State.READY),
        ((State.RELEASED,), State.RESIDENT),
        ((State.RELEASED,), State.RELEASED),
    ],
)
def test_forbidden_transitions_raise(path, bad):
    record = Record(torch.randn(4), _Run(), 3)
    for state in path:
        record.to(state)
    with pytest.raises(RecordStateError, match=f"record 3 of block 'block' cannot go from .* to {bad.value}"):
        record.to(bad)


def _views():
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    return {
        "contiguous": base,
        "transposed": base.transpose(0, 2),
        "offset": base[1:],
        "expanded": base[:1].expand(5, 6, 8),
        "gappy": base[:, :, ::4],
        "narrow_last": base[..., 2:5],
        "scalar": base[0, 0, 3],
        "bool": base > 100,
        "int64": base.long()[2:],
        "bf16": base.bfloat16().transpose(1, 2),
    }


@pytest.mark.parametrize("name", list(_views()))
def test_layout_round_trip_is_exact(name):
    tensor = _views()[name]
    geometry = TensorGeometry(tensor)
    flat = geometry.flat(tensor).clone()  # what the host copy holds
    assert flat.numel() == geometry.span
    buffer = torch.empty(geometry.pad + geometry.span, dtype=tensor.dtype)
    buffer[geometry.pad :].copy_(flat)
    rebuilt = geometry.rebuild(buffer)
    assert torch.equal(rebuilt, tensor)
    assert rebuilt.shape == tensor.shape
    if not geometry.compact:
        assert rebuilt.stride() == tensor.stride()
        # Alignment relative to 256 bytes is kept, so kernels choose the same paths.
        assert (rebuilt.data_ptr() - buffer.data_ptr()) % 256 == (
            tensor.storage_offset() * tensor.element_size()
        ) % 256


def test_gappy_views_are_copied_compactly():
    base = torch.randn(64, 64)
    geometry = TensorGeometry(base[:, ::8])
    assert geometry.compact and geometry.nbytes == 64 * 8 * 4


def test_expanded_views_copy_only_their_storage():
    geometry = TensorGeometry(torch.randn(1, 1000).expand(500, 1000))
    assert geometry.nbytes == 1000 * 4
