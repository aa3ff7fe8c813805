"""actoff: activation offloading for long-context transformer training on one GPU.

Decorate transformer blocks with `offload` (or apply `offload_` to a model) and every tensor
autograd saves inside them is placed by policy: kept on the device, copied to host memory,
or written to NVMe, and brought back exactly for backward. Policy comes from ``ACTOFF_*``
environment variables (`Config.from_env`) or from Python.

Example:
    >>> import torch, actoff
    >>> from actoff.reference import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig.preset("tiny"))
    >>> _ = actoff.offload_(model, block_cls=actoff.reference.Block, policy="cpu", min_bytes=0)
    >>> tokens = torch.randint(0, model.config.vocab_size, (2, 32))
    >>> model.loss(tokens).backward()
    >>> actoff.stats().total_bytes_offloaded > 0
    True
"""

from ._version import __version__
from .budget import BudgetWarning
from .config import Config, get_config, parse_size, set_config
from .introspect import check_kvikio, format_bytes, held_bytes, open_io_engine, trace_arenas
from .memory import replay_allocator
from .memory.replay_allocator import AllocatorStats
from .memory.replay_allocator import install as install_replay_allocator
from .memory.replay_allocator import stats as replay_allocator_stats
from .reporting import Report, report
from .runtime.runtime import get_runtime, reset_runtimes
from .runtime.stats import BlockStats, Stats
from .scope.offload import no_offload, offload, offload_
from .tiers.nvme.kvikio import kvikio_available
from .tiers.tokenwise.mixers import register_token_mixer
from .tiling.loss import chunked_cross_entropy, chunked_loss_
from .tiling.tile import tile_

try:
    from . import _C  # noqa: F401

    HAS_EXTENSION = True
except ImportError:
    HAS_EXTENSION = False

#: `check_kvikio`'s name until 0.1 ("probe" is token-wise recompute's word now); kept for a release.
probe_kvikio = check_kvikio

# ACTOFF_ALLOCATOR=replay must swap torch's CUDA allocator before the first CUDA allocation:
# importing actoff is the earliest point actoff runs. A refusal is raised at the first CUDA step.
replay_allocator.install_from_environment()

__all__ = [
    "HAS_EXTENSION",
    "AllocatorStats",
    "BlockStats",
    "BudgetWarning",
    "Config",
    "Report",
    "Stats",
    "__version__",
    "check_kvikio",
    "chunked_cross_entropy",
    "chunked_loss_",
    "format_bytes",
    "get_config",
    "held_bytes",
    "install_replay_allocator",
    "kvikio_available",
    "no_offload",
    "offload",
    "offload_",
    "open_io_engine",
    "parse_size",
    "register_token_mixer",
    "replay_allocator_stats",
    "report",
    "reset",
    "set_config",
    "stats",
    "tile_",
    "trace_arenas",
]


def stats() -> Stats:
    """Figures of the calling thread's last step: per block bytes saved, bytes per tier, copy times.

    Example:
        >>> import actoff
        >>> print(actoff.stats())  # doctest: +ELLIPSIS
        block ...
    """
    return get_runtime().stats()


def reset() -> None:
    """Forget statistics and the current step, and close NVMe stores (freeing their files), of
    every thread's runtime.

    Call it between independent runs in one process (tests, benchmarks), while no thread trains.

    Example:
        >>> import actoff
        >>> actoff.reset()
        >>> actoff.stats().steps
        0
    """
    reset_runtimes()
