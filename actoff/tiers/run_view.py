"""What a tier sees of the scope run that saved a record: a narrow view, never the runtime behind it.

Note [tiers see a view of their run]: a record's ``run`` is a scope run (actoff.runtime.step.ScopeRun),
but the tiers know it only through `RunView`: its name and place in the step, its device and
settings, where its bytes may go (host arena, device buffers, the NVMe store), its figures, and
the few things a tier asks of the runtime (quarantine a buffer a hung request may still touch,
say something once, release a record it made, let a re-run's nested scopes pass through). So the
tiers import nothing above them and the runtime's state stays the runtime's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from actoff.config import Config
    from actoff.device.base import DeviceBackend, Ticket
    from actoff.figures import BlockStats
    from actoff.memory.host_arena import HostArena

    from .nvme.store import NvmeStore
    from .record import Record

__all__ = ["RunView"]


class RunView(Protocol):
    """A scope run as its records' tiers see it (Note [tiers see a view of their run])."""

    name: str  # the block's name, for messages and statistics
    index: int  # its place among the step's runs (device arena keys)
    device: torch.device
    config: Config
    backend: DeviceBackend
    stats: BlockStats  # the run's figures: tiers count bytes and times into them
    records: list[Record]  # in pack order
    param_storages: set[int]  # never offloaded (actoff.params)
    min_bytes: int  # saved tensors under this stay where they are (config's, 0 at the floor)

    @property
    def step_number(self) -> int:
        """The number of the step the run belongs to."""
        ...

    def arena(self) -> HostArena:
        """The host arena of the run's device."""
        ...

    def device_buffer(self, numel: int, dtype: torch.dtype, key: tuple) -> torch.Tensor:
        """A 1-D device tensor for a copy back or a rebuild of ``key`` (what, record index)."""
        ...

    def store(self) -> NvmeStore:
        """The NVMe store of the run's settings."""
        ...

    def account(self, what: str, ticket: Ticket | None) -> None:
        """Add a copy's time to the figure ``what`` now, or once the copy is done."""
        ...

    def account_io(self, what: str, future: Any) -> None:
        """Add an NVMe request's time to the figure ``what``."""
        ...

    def quarantine(self, *held: object) -> None:
        """Never hand out ``held`` (extents, buffers) again: a request that timed out may still
        touch them (Note [hung I/O])."""
        ...

    def warn_once(self, key: str, message: str) -> None:
        """Say ``message`` once per runtime for ``key``."""
        ...

    def host_refused(self, record: Record) -> bool:
        """The host budget had no room for ``record``: True where the run took care of it (the
        NVMe file took it: Note [a full host spills to NVMe] in actoff.tiers.nvme.tier; or it
        runs the block again in backward), False where the record stays on the device."""
        ...

    def hold(self, tensor: torch.Tensor, nbytes: int) -> tuple[Record, object]:
        """A record of ``tensor`` that the run holds itself (not autograd): the record, and the
        handle that keeps it alive (dropping the handle releases it, as autograd's would)."""
        ...

    def adopt(self, record: Record) -> None:
        """Count a record a tier made for the run (packed token rows) among the step's live ones."""
        ...

    def release(self, record: Record) -> None:
        """Release a record the tier made (`adopt`) and no longer needs."""
        ...

    def nested(self) -> AbstractContextManager[None]:
        """While a re-run of the block runs: scopes inside it pass through."""
        ...
