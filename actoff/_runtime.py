"""Runtime: scope runs, the pack/unpack hooks, the step lifecycle and record release.

Data flow of one step (DESIGN.md):
1. Forward inside a scope: `ScopeRun.pack` takes each saved tensor, filters it, dedups it and
   returns a `Handle` to a `Record`. Nothing is copied yet.
2. Scope exit: the run is sealed and queued; once it is more than ``keep_last`` runs old its
   records are placed (cpu or nvme) and their copies start off the compute stream.
3. Backward: the first unpack in a run fetches all of that run's records and prefetches the
   previous run's; unpack waits on exactly the record it serves.
4. End of backward (autograd final callback): device copies kept for ``retain_graph`` are
   evicted, statistics are published, and the host arena consolidates.

A record is released when autograd drops its handle (after its last use, or when a retained
graph is freed), so ``retain_graph=True`` and partial backward passes need no special case.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import hashlib
import os
import threading
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from ._arena import ALIGNMENT, HostArena
from ._config import Config
from ._device import DeviceBackend, Ticket, backend_for
from ._pack import pack_rows, scatter_rows
from ._recompute import (
    CaptureMode,
    CollectiveWatch,
    ReplayMismatch,
    ReplayMode,
    autograd_status,
    rows_like,
    slice_inputs,
)
from ._record import Record, State
from ._stats import BlockStats, Stats
from ._tokenwise import AutoDecision, TokenRanges, auto_fractions, base_info, detect_canon, token_ranges
from .planner import Buffer, Layout, PlanCache, solve

__all__ = ["Handle", "Runtime", "ScopeRun", "get_runtime"]


class Handle:
    """What autograd stores instead of a saved tensor. Dropping it releases the record."""

    __slots__ = ("record",)

    def __init__(self, record: Record) -> None:
        self.record = record

    def __del__(self) -> None:
        runtime = _runtime
        if runtime is not None:  # None only during interpreter shutdown
            runtime.release(self.record)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[ScopeRun] = []
        self.disabled = 0


class Step:
    """The scope runs of one forward pass, in order, until its backward ends."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.runs: list[ScopeRun] = []
        self.pending: collections.deque[ScopeRun] = collections.deque()  # sealed, not placed
        self.modules: set[int] = set()  # ids of module scopes entered (re-entry: new step)
        self.in_flight: list[ScopeRun] = []  # placed runs with copies out not yet finished
        self.last_placed: ScopeRun | None = None
        self.live = 0  # records not yet released
        self.timings: list[tuple[ScopeRun, str, Ticket]] = []  # copies to time at the end
        self.backward_started = False
        self.callback_queued = False
        self.aborted = False


class ScopeRun:
    """One forward call of an offload scope and the records it made."""

    def __init__(
        self,
        runtime: Runtime,
        step: Step,
        name: str,
        config: Config,
        backend: DeviceBackend,
        param_storages: set[int],
    ) -> None:
        self.runtime = runtime
        self.step = step
        self.index = len(step.runs)
        self.name = name
        self.config = config
        self.backend = backend
        self.device = backend.device
        self.param_storages = param_storages
        self.records: list[Record] = []
        self.dedup: dict[tuple, Handle] = {}
        self.stats = BlockStats(name, calls=1)
        self.fetch_issued = False
        # Token-wise runs only (see Note [token-wise replay] in actoff._recompute).
        self.tokenwise = False
        self.events: list[int] | None = None  # record index per non-parameter save, -1: not a record
        self.in_mixer = 0
        self.collective: str | None = None  # first collective outside a mixer (CollectiveWatch)
        self.seq_len = 0
        self.fn: Callable[..., Any] | None = None
        self.input_spec: Any = None  # pytree structure of (args, kwargs)
        self.inputs: list[Any] = []  # their flattened leaves: Record, or the value itself
        self.input_status: list[str | None] = []  # autograd_status of each input at capture
        self.mixer_outputs: list[tuple[Any, int | None]] = []  # (Record or tensor, token dim)
        self.owned: list[Handle] = []  # handles actoff holds for inputs and mixer outputs
        self.rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.ranges: TokenRanges | None = None
        self.children: list[Record] = []  # packed rows, one record per stored tier
        self.bundles: dict[str, tuple[Record, list[int], tuple[int, int]]] = {}
        self.split_records: list[Record] = []
        self.split_live = 0
        self.split_pending = 0
        self.replay_rows: dict[int, torch.Tensor] | None = None
        self.verify_rows: tuple[int, torch.Tensor] | None = None  # ACTOFF_VERIFY's kept copy
        self.forward_watch = None  # time of the forward (the auto policy's T_layer)
        self.auto_sample: tuple[int, int, int] | None = None  # input, attention, other bytes

    # Note [pack is hot]: runs for every saved tensor; keep it to a few attribute reads.
    def pack(self, tensor: torch.Tensor) -> Any:
        if self.runtime.thread.disabled:
            return tensor
        events = self.events if not self.in_mixer else None
        nbytes = tensor.numel() * tensor.element_size()
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout != torch.strided
            or tensor.is_quantized
            or tensor.device != self.device
            or nbytes == 0
        ):
            if isinstance(tensor, torch.nn.Parameter):
                self.stats.skipped_param_bytes += nbytes
                return tensor
            self.stats.skipped_other_bytes += nbytes
            if events is not None:
                events.append(-1)
            return tensor
        storage = tensor.untyped_storage().data_ptr()
        if param_like(tensor, storage, self.param_storages):
            self.stats.skipped_param_bytes += nbytes
            return tensor
        if nbytes < self.config.min_bytes:
            self.stats.skipped_small_bytes += nbytes
            if events is not None:
                events.append(-1)
            return tensor
        handle = self._handle_for(tensor, storage)
        if events is not None:
            events.append(handle.record.index)
        return handle

    def _handle_for(self, tensor: torch.Tensor, storage: int) -> Handle:
        # The storage offset is part of the key: q/k/v views of one fused projection share a
        # storage and must not collide. The version keeps a modified tensor apart.
        key = (storage, tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype, tensor._version)
        handle = self.dedup.get(key)
        if handle is not None:
            self.stats.dedup_hits += 1
            return handle
        record = Record(tensor, self, len(self.records))
        if self.tokenwise:
            if self.in_mixer:
                record.whole = True  # the mixer's saves are not replayed: stored whole
            else:
                record.base_info = base_info(tensor)
        self.records.append(record)
        self.step.live += 1
        handle = Handle(record)
        self.dedup[key] = handle
        return handle

    def keep_whole(self, value: Any) -> Any:
        """A record (stored whole, held by actoff) for a block input or mixer output tensor, or
        the value itself when actoff would not offload it (small, a parameter, not a tensor)."""
        if not isinstance(value, torch.Tensor):
            return value
        # Held directly: a detached alias (Note [no cycle through autograd]).
        if type(value) is not torch.Tensor or value.device != self.device:
            return value.detach()
        storage = value.untyped_storage().data_ptr() if value.numel() else 0
        if (
            value.numel() == 0
            or value.layout != torch.strided
            or param_like(value, storage, self.param_storages)
            or value.numel() * value.element_size() < self.config.min_bytes
        ):
            return value.detach()
        handle = self._handle_for(value, storage)
        handle.record.whole = True
        self.owned.append(handle)
        return handle.record

    def capture_mixer_output(self, output: Any, token_dim: int | None) -> None:
        self.mixer_outputs.append((self.keep_whole(output), token_dim))


TOKENWISE_POLICIES = ("tokenwise", "recompute", "auto")


def local_world_size() -> int:
    """Processes sharing this host (torchrun's LOCAL_WORLD_SIZE; 1 when not distributed)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _distributed_rank() -> int | None:
    """This process's rank when torch.distributed runs with more than one rank, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.get_rank()


def _broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank when torch.distributed runs (one decision, not one per
    rank: ranks deciding apart can disagree); ``value`` itself otherwise."""
    import torch.distributed as dist

    if _distributed_rank() is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def whole_tier(config: Config) -> str:
    """Where a policy puts what it stores whole: the block's input, mixer saves, fallbacks."""
    if config.policy in ("cpu", "nvme", "keep"):
        return config.policy
    return (
        "nvme"
        if config.policy == "tokenwise" and config.cpu_fraction == 0 and config.nvme_fraction > 0
        else "cpu"
    )


def param_like(tensor: torch.Tensor, storage: int, param_storages: set[int]) -> bool:
    """Parameters, buffers and their views (by storage), and leaves that require grad."""
    if storage in param_storages or (tensor.is_leaf and tensor.requires_grad):
        return True
    base = tensor._base
    return base is not None and base.is_leaf and base.requires_grad


def _unpack(packed: Any) -> torch.Tensor:
    if type(packed) is not Handle:
        return packed
    return packed.record.run.runtime.unpack(packed.record)


class Runtime:
    """Process-wide state: the current step, host arenas, NVMe stores and statistics."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.thread = _ThreadState()
        self.step: Step | None = None
        self.steps_started = 0
        self.steps_completed = 0
        self.arenas: dict[torch.device, HostArena] = {}
        self.last_stats: dict[str, BlockStats] = {}
        # (block, seq_len) -> {record index: (size, stride, Canon)} from a verified probe replay
        self.token_plans: dict[tuple[str, int], dict[int, tuple]] = {}
        self.verdicts: dict[str, str] = {}  # blocks placed whole, and why
        self.auto_decisions: dict[str, AutoDecision] = {}
        self.quarantine: list[tuple] = []  # Note [hung I/O]: memory and extents never reused
        self.plans: dict[str, Layout] = {}  # trace signature -> layout (issue 5's planner)
        self.agreed = False  # Note [one agreement]: rank 0's first-step decisions are in
        self.bandwidths: dict[torch.device, float] = {}  # measured host link, bytes/s
        self._warned: set[str] = set()
        from ._nvme import StoreRegistry  # deferred: _nvme imports nothing from here at load

        self.stores = StoreRegistry()

    # ------------------------------------------------------------------ scopes
    def call(
        self,
        name: str,
        config: Config,
        module: torch.nn.Module | None,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` as an offload scope (or pass through, see `passes_through`)."""
        if self.passes_through(module):
            return fn(*args, **kwargs)
        device = _find_device(args, kwargs, module)
        run = self._begin(name, config, module, device)
        if run.tokenwise:
            self._capture_inputs(run, fn, args, kwargs)
        self.thread.stack.append(run)
        try:
            with torch.autograd.graph.saved_tensors_hooks(run.pack, _unpack):
                if run.tokenwise:
                    run.forward_watch = run.backend.stopwatch().start()
                    probing = (name, run.seq_len) not in self.token_plans
                    with CaptureMode(run), CollectiveWatch(run) if probing else contextlib.nullcontext():
                        output = fn(*args, **kwargs)
                    run.forward_watch.stop()
                else:
                    output = fn(*args, **kwargs)
        except BaseException:
            self.thread.stack.pop()
            self._abort(run)
            raise
        self.thread.stack.pop()
        self._seal(run)
        return output

    def passes_through(self, module: torch.nn.Module | None) -> bool:
        """Nested scopes, ``no_offload()``, ``torch.no_grad()`` and eval mode run untouched."""
        return bool(
            self.thread.stack
            or self.thread.disabled
            or not torch.is_grad_enabled()
            or (module is not None and not module.training)
        )

    def _begin(
        self, name: str, config: Config, module: torch.nn.Module | None, device: torch.device
    ) -> ScopeRun:
        with self.lock:
            step = self.step
            module_id = id(module) if module is not None else None
            # A new step starts after a backward began, after an aborted forward, or when a
            # module scope comes round again (a forward without backward in between).
            if step is None or step.backward_started or step.aborted or module_id in step.modules:
                if step is not None:  # finish its copies: their sources can go now
                    step.last_placed = None
                    self._progress(step)
                self._publish(step)
                for arena in self.arenas.values():
                    arena.begin_step()
                step = self.step = Step(self.steps_started)
                self.steps_started += 1
            if module_id is not None:
                step.modules.add(module_id)
            params = set()
            if module is not None:
                for tensor in (*module.parameters(), *module.buffers()):
                    params.add(tensor.untyped_storage().data_ptr())
            run = ScopeRun(self, step, name, config, backend_for(device), params)
            run.tokenwise = config.policy in TOKENWISE_POLICIES and self.verdicts.get(name) is None
            step.runs.append(run)
            return run

    def _capture_inputs(self, run: ScopeRun, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """What the re-forward needs: the inputs (kept whole), the function, the RNG state."""
        token_dim = run.config.token_dim
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or first.dim() <= token_dim:
            run.tokenwise = False  # no token dimension to slice: placed whole
            return
        run.seq_len = first.shape[token_dim]
        # Inputs may nest (Hugging Face passes position_embeddings=(cos, sin)): flatten them.
        values, run.input_spec = pytree.tree_flatten((args, kwargs))
        run.fn = fn
        run.input_status = [autograd_status(value) for value in values]
        run.inputs = [run.keep_whole(value) for value in values]
        run.events = []
        cuda_state = torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None
        run.rng = (torch.get_rng_state(), cuda_state)

    def _abort(self, run: ScopeRun) -> None:
        # An exception inside the scope: nothing is copied; the records stay resident and
        # are released when the partial graph holding their handles is freed.
        with self.lock:
            run.dedup.clear()
            run.owned.clear()
            run.step.aborted = True
            run.step.pending.clear()  # never placed now: their graph is being torn down

    def _seal(self, run: ScopeRun) -> None:
        with self.lock:
            run.dedup.clear()  # Note [pack is hot]: the handles now live in autograd only
            if run.tokenwise:
                self._prepare_tokenwise(run)
            step = run.step
            if run.config.policy != "keep":
                step.pending.append(run)
                while len(step.pending) > run.config.keep_last:
                    self._place(step.pending.popleft())
            self._progress(step)

    # ------------------------------------------------------------------ placement
    def _place(self, run: ScopeRun) -> None:
        tier = whole_tier(run.config)
        if run.tokenwise:
            self._place_split(run)
        for record in run.records:
            if record.state is State.RESIDENT:
                self._offload(record, tier)
        if not run.split_records:
            run.owned.clear()  # nothing will be recomputed: inputs and mixer outputs go
        run.step.in_flight.append(run)
        run.step.last_placed = run

    # ------------------------------------------------------------------ token-wise
    def _prepare_tokenwise(self, run: ScopeRun) -> None:
        """Choose the ranges and the records to split; probe and verify once per block and length."""
        config = run.config
        candidates = [r for r in run.records if not r.whole and not r.layout.compact]
        if config.policy == "auto":
            decision = self.auto_decisions.get(run.name)
            if decision is None:  # first step: measure, store whole, decide after backward
                run.auto_sample = (
                    sum(v.layout.nbytes for v in run.inputs if isinstance(v, Record)),
                    sum(v.layout.nbytes for v, _ in run.mixer_outputs if isinstance(v, Record)),
                    sum(r.layout.nbytes for r in candidates),
                )
                run.tokenwise = False
                return
            cpu, nvme = decision.cpu_fraction, decision.nvme_fraction
        elif config.policy == "recompute":
            cpu, nvme = 0.0, 0.0
        else:
            cpu, nvme = config.cpu_fraction, config.nvme_fraction
        run.ranges = token_ranges(run.seq_len, cpu, nvme)
        if not candidates or run.ranges.cpu_end == run.seq_len:
            run.tokenwise = False  # nothing to split (or every token to host memory): whole
            return
        key = (run.name, run.seq_len)
        plan = self.token_plans.get(key)
        if plan is None:
            if run.collective is None:
                plan, reason = self._probe(run, candidates)
            else:  # never re-run it, not even to probe: see CollectiveWatch
                plan, reason = (
                    None,
                    (
                        f"its forward calls the collective {run.collective} outside a token mixer, and a "
                        "re-forward on one rank's token slice would call it again (register the function "
                        "that communicates, e.g. a sequence-parallel attention, with actoff.register_token_mixer)"
                    ),
                )
            if plan is None:
                self.verdicts[run.name] = reason
                run.tokenwise = False
                self.warn_once(
                    f"tokenwise:{run.name}",
                    f"actoff: block {run.name!r} cannot be recomputed token-wise: {reason}. Its "
                    f"activations are placed whole ({whole_tier(config)}) from now on; gradients stay exact.",
                )
                return
            self.token_plans[key] = plan
        for record in candidates:
            entry = plan.get(record.index)
            if entry is not None and entry[:2] == (record.layout.size, record.layout.stride):
                record.canon = entry[2]
                run.split_records.append(record)
        if not run.split_records:
            run.tokenwise = False

    def _probe(self, run: ScopeRun, candidates: list[Record]) -> tuple[dict[int, tuple] | None, str]:
        """Re-run the block on its last tokens while everything is live: find each record's
        token dimension (the one that shrank) and check the rows against the real ones."""
        seq_len = run.seq_len
        recompute = run.ranges.recompute_len
        length = recompute if 0 < recompute < seq_len else seq_len // 2
        if length < 1:
            return None, f"a sequence of {seq_len} token(s) cannot be sliced"
        start = seq_len - length
        try:
            saved = self._replay(run, start, seq_len, detect=candidates)
        except ReplayMismatch as error:
            return None, str(error)
        except Exception as error:  # the block cannot run on a token slice at all
            return (
                None,
                f"the re-forward on tokens [{start}, {seq_len}) raised {type(error).__name__}: {error}",
            )
        plan: dict[int, tuple] = {}
        for record in candidates:
            replayed = saved.get(record.index)
            if replayed is None:
                continue
            view = (record.layout.size, record.layout.stride)
            canon = detect_canon(view, record.base_info, replayed, seq_len, length)
            if canon is None:
                continue  # no token dimension we can trust: stored whole
            original = canon.view(record.layout.flat(record.device_tensor.detach())).narrow(
                canon.dim, start, length
            )
            if not _rows_match(original, canon.source(replayed).detach()):
                return None, (
                    f"saved tensor {record.index} (shape {list(record.layout.size)}) differs after "
                    f"recompute on tokens [{start}, {seq_len}) (attention written out without a "
                    "registered token mixer, positions computed inside the block, or dropout?)"
                )
            plan[record.index] = (record.layout.size, record.layout.stride, canon)
        if not plan:
            return None, "no saved tensor has a token dimension"
        return plan, ""

    def _replay(
        self, run: ScopeRun, start: int, stop: int, *, detect: list[Record] | None = None
    ) -> dict[int, torch.Tensor]:
        """Note [token-wise replay]: the block's forward on token rows ``[start, stop)``.

        Returns, per record, its re-forward save: for ``detect``'s records the saved tensor as
        it is (to find the token dimension), else the rows in the record's canonical shape.
        """
        length = stop - start
        values = [self._whole_value(v) for v in run.inputs]
        with torch.enable_grad():  # backward runs with grad off; the sliced inputs need it on
            sliced = slice_inputs(values, run.input_status, run.seq_len, run.config.token_dim, start, stop)
        args, kwargs = pytree.tree_unflatten(sliced, run.input_spec)
        mixer_rows = []
        for value, dim in run.mixer_outputs:
            if dim is None:
                raise ReplayMismatch("a token mixer's output has no token dimension actoff can find")
            mixer_rows.append(rows_like(self._whole_value(value), dim, start, stop))
        wanted = {r.index: r for r in (detect if detect is not None else run.split_records)}
        events, rows, count = run.events, {}, [0]

        def pack(tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
            if isinstance(tensor, torch.nn.Parameter) or param_like(tensor, storage, run.param_storages):
                return None
            k = count[0]
            count[0] += 1
            if k >= len(events):
                raise ReplayMismatch(f"the re-forward saved more tensors than the forward ({len(events)})")
            record = wanted.get(events[k])
            if record is None or record.index in rows:
                return None
            if detect is not None:
                rows[record.index] = tensor
                return None
            expected = list(record.canon.shape)
            expected[record.canon.dim] = length
            candidate = record.canon.source(tensor)
            if candidate is None or list(candidate.shape) != expected:
                raise ReplayMismatch(
                    f"saved tensor {k} has shape {list(tensor.shape)}; the forward's record "
                    f"{record.index} needs {expected} on {length} tokens"
                )
            rows[record.index] = candidate.detach()
            return None

        mode = ReplayMode(mixer_rows)
        devices = [run.device] if run.device.type == "cuda" else []
        self.thread.stack.append(run)  # nested scopes inside the block pass through
        try:
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                torch.set_rng_state(run.rng[0])
                if run.rng[1] is not None:
                    torch.cuda.set_rng_state(run.rng[1], run.device)
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed), mode:
                    run.fn(*args, **kwargs)
        finally:
            self.thread.stack.pop()
        if count[0] != len(events):
            raise ReplayMismatch(f"the re-forward saved {count[0]} tensors, the forward {len(events)}")
        if mode.calls != len(mixer_rows):
            raise ReplayMismatch(
                f"the re-forward called the token mixer {mode.calls} times, the forward {len(mixer_rows)}"
            )
        if detect is None:
            missing = [i for i in wanted if i not in rows]
            if missing:
                raise ReplayMismatch(f"the re-forward did not produce records {missing}")
        return rows

    def _whole_value(self, value: Any) -> Any:
        return self._materialize(value) if isinstance(value, Record) else value

    def _place_split(self, run: ScopeRun) -> None:
        """Pack the stored token rows of every split record into one buffer per tier."""
        ranges = run.ranges
        for tier, (low, high) in (("cpu", (0, ranges.cpu_end)), ("nvme", (ranges.cpu_end, ranges.nvme_end))):
            if high <= low:
                continue
            views = [
                r.canon.view(r.layout.flat(r.device_tensor)).narrow(r.canon.dim, low, high - low)
                for r in run.split_records
            ]
            buffer, offsets = pack_rows(views)
            child = Record(buffer, run, -1)
            run.step.live += 1
            run.children.append(child)
            run.bundles[tier] = (child, offsets, (low, high))
            self._offload(child, tier)
        start, stop = ranges.recompute
        if run.config.verify and stop > start and run.step.number % run.config.verify_interval == 0:
            # Keep one recomputed range: backward checks the re-forward against it.
            record = run.split_records[0]
            kept = record.canon.view(record.layout.flat(record.device_tensor.detach()))
            run.verify_rows = (
                record.index,
                kept.narrow(record.canon.dim, start, stop - start).to("cpu", copy=True),
            )
        for record in run.split_records:
            record.split = ranges
            record.tier = "tokenwise"
            record.device_tensor = None  # the packed copies hold what is stored
            record.to(State.OFFLOADING)
            record.to(State.OFFLOADED)
        run.split_live = len(run.split_records)

    def _rebuild(self, record: Record) -> torch.Tensor:
        """A split record again: stored rows scattered back, dropped rows recomputed."""
        run, layout = record.run, record.layout
        if run.replay_rows is None:
            for child in run.children:
                self._materialize(child)
            start, stop = run.ranges.recompute
            watch = run.backend.stopwatch().start()
            run.replay_rows = self._replay(run, start, stop) if stop > start else {}
            self._account(run, "recompute_ms", watch.stop())
            run.split_pending = len(run.split_records)
        flat = torch.empty(layout.pad + layout.span, dtype=layout.dtype, device=run.device)
        canon = record.canon.view(flat, layout.pad)
        position = run.split_records.index(record)
        for child, offsets, (low, high) in run.bundles.values():
            scatter_rows(
                child.device_tensor, [offsets[position]], [canon.narrow(record.canon.dim, low, high - low)]
            )
        start, stop = run.ranges.recompute
        if stop > start:
            rows = run.replay_rows.pop(record.index)
            if run.verify_rows is not None and run.verify_rows[0] == record.index:
                if not _rows_match(run.verify_rows[1], rows.detach().cpu()):
                    raise RuntimeError(
                        f"actoff: recomputed token rows [{start}, {stop}) of a saved activation of block "
                        f"{run.name!r} differ from the copy kept at forward time (ACTOFF_VERIFY=1): the "
                        "block computed something else in backward (changed weights or state, "
                        "nondeterministic ops). The step cannot continue with this activation."
                    )
                run.verify_rows = None
            canon.narrow(record.canon.dim, start, stop - start).copy_(rows)
        record.device_tensor = layout.rebuild(flat)
        record.to(State.FETCHING)
        record.to(State.READY)
        run.split_pending -= 1
        if run.split_pending == 0:  # every split record rebuilt: drop the packed device copies
            for child in run.children:
                self._evict(child)
        return record.device_tensor

    def _offload(self, record: Record, tier: str) -> None:
        run, layout = record.run, record.layout
        source = layout.flat(record.device_tensor)
        if tier == "nvme" and not run.backend.pinned:
            # Host-resident tensors go straight to the file; no staging copy.
            store = self.stores.get(run.config)
            if run.config.verify:
                record.checksum = _crc(source)
            record.extent, record.write_future = store.write(source, layout.nbytes)
            record.store = store
            record.copy_source = source
            record.tier = "nvme"
            record.to(State.OFFLOADING)
            return
        slot = self.arena(run).alloc(layout.nbytes, tag=run.index)
        if slot is None:
            run.stats.over_budget_bytes += layout.nbytes
            return  # stays resident: the host budget is full
        record.host_slot = slot
        record.copy_source = source  # Note [no record_stream]: held until the copy is done
        record.copy_ticket = run.backend.copy_to_host(slot.view(layout.dtype, layout.span), source)
        record.tier = tier
        record.to(State.OFFLOADING)

    def _progress(self, step: Step) -> None:
        """Advance copies out: finish what completed; runs older than the last placed must finish.

        MEMO's double buffering: the copies of run i overlap the forward of run i+1 and are
        waited for (stream-side, no host stall) when the next run is placed.
        """
        still: list[ScopeRun] = []
        for run in step.in_flight:
            force = run is not step.last_placed
            busy = False
            for record in (*run.records, *run.children):
                if record.state is State.OFFLOADING:
                    self._advance(record, force=force)
                    busy = busy or record.state is State.OFFLOADING
            if busy:
                still.append(run)
        step.in_flight = still

    def flush(self) -> None:
        """Finish every copy out of the current step (writes included) before returning."""
        with self.lock:
            step = self.step
            if step is None:
                return
            step.last_placed = None  # nothing is exempt: force all
            self._progress(step)

    def _advance(self, record: Record, *, force: bool) -> None:
        """Move an OFFLOADING record on; ``force`` waits (stream-side where possible)."""
        run = record.run
        ticket = record.copy_ticket
        if ticket is not None and record.tier == "nvme" and record.write_future is None:
            # Staged NVMe write: the host copy must be complete before the file write starts.
            if not ticket.query():
                if not force:
                    return
                ticket.synchronize()
            store = self.stores.get(run.config)
            slot = record.host_slot
            if run.config.verify:
                record.checksum = _crc(slot.view(record.layout.dtype, record.layout.span))
            # The whole aligned slot: aligned address, size and offset take O_DIRECT.
            record.extent, record.write_future = store.write(slot.raw(), slot.capacity)
            record.store = store
        if record.write_future is not None:
            if not record.write_future.done() and not force:
                return
            try:
                record.write_future.wait(run.config.io_timeout)
            except Exception as error:  # an OSError, a timeout, or a worker that died
                self._write_failed(record, error)
                return
            self._account_io(run, "copy_ms", record.write_future)
            record.write_future = None
            if record.host_slot is not None:  # staging slot: the file has the bytes now
                self.arena(run).free(record.host_slot)
                record.host_slot = None
        elif ticket is not None:
            if run.config.verify:
                ticket.synchronize()  # the checksum reads the host bytes
                record.checksum = _crc(record.host_slot.view(record.layout.dtype, record.layout.span))
            elif force:
                run.backend.wait(ticket)
            elif not ticket.query():
                return
        self._account(run, "copy_ms", ticket)
        record.copy_ticket = None
        record.device_tensor = None
        record.copy_source = None
        record.to(State.OFFLOADED)

    @staticmethod
    def _account(run: ScopeRun, what: str, ticket: Ticket | None) -> None:
        """Add a copy's time to the run's figures now, or at the end of backward if in flight."""
        if ticket is None:
            return
        if ticket.query():
            setattr(run.stats, what, getattr(run.stats, what) + ticket.elapsed_ms())
        else:
            run.step.timings.append((run, what, ticket))

    @staticmethod
    def _account_io(run: ScopeRun, what: str, future: object) -> None:
        # NVMe requests: the time the engine spent on them (queueing excluded).
        setattr(run.stats, what, getattr(run.stats, what) + future.elapsed() * 1e3)

    def _write_failed(self, record: Record, error: Exception) -> None:
        # Nothing is lost: the bytes are still in the staging slot (-> cpu tier) or in the
        # device tensor, which the record still holds (-> keep).
        run = record.run
        run.stats.write_fallback_bytes += record.layout.nbytes
        if _timed_out(error):
            # Note [hung I/O]: a worker that hangs may still write this extent later: never
            # hand it out again (and keep the source it reads from alive).
            self.quarantine.append((record.extent, record.copy_source))
        else:
            record.store.free(record.extent)
        record.extent = None
        record.write_future = None
        if record.host_slot is not None:
            record.tier = "cpu"
            record.copy_source = None
            record.device_tensor = None
            record.to(State.OFFLOADED)
            fallback = "host memory"
        else:
            record.tier = "keep"
            record.copy_source = None
            record.to(State.RESIDENT)
            fallback = "the device"
        self.warn_once(
            f"nvme-write:{run.config.nvme_dir}",
            f"actoff: an NVMe write failed ({error}); affected activations stay in {fallback} "
            "and training continues with exact values. Free space or fix ACTOFF_NVME_DIR.",
        )

    # ------------------------------------------------------------------ backward
    def unpack(self, record: Record) -> torch.Tensor:
        """Serve a saved tensor to autograd (called from the backward threads)."""
        with self.lock:
            run = record.run
            step = run.step
            step.backward_started = True
            if not step.callback_queued:
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_backward(step))
                    step.callback_queued = True
                except RuntimeError:
                    pass  # unpacked outside a backward pass (e.g. grad_fn._saved_self)
            record.check_version()
            if not run.fetch_issued:
                self._prefetch(run)
                if run.index > 0:
                    self._prefetch(step.runs[run.index - 1])
            return self._materialize(record)

    def _prefetch(self, run: ScopeRun) -> None:
        run.fetch_issued = True
        for record in (*run.records, *run.children):
            if record.state is State.OFFLOADED and record.split is None and record.live_source() is None:
                self._fetch(record)

    def _fetch(self, record: Record) -> None:
        run, layout = record.run, record.layout
        if record.tier == "nvme":
            store = record.store
            if run.backend.pinned:
                slot = self.arena(run).alloc(layout.nbytes, tag=run.index)
                if slot is None:
                    raise RuntimeError(
                        f"actoff: no host staging memory to read {layout.nbytes} bytes back from "
                        f"NVMe for block {run.name!r}: raise ACTOFF_HOST_BUDGET"
                    )
                record.host_slot = slot
                record.write_future = store.read(slot.raw(), record.extent, slot.capacity)
                record.copy_source = slot.view(layout.dtype, layout.span)
            else:
                flat = torch.empty(layout.pad + layout.span, dtype=layout.dtype, device=run.device)
                record.device_tensor = layout.rebuild(flat)
                record.copy_source = flat[layout.pad :]
                record.write_future = store.read(record.copy_source, record.extent, layout.nbytes)
        else:
            host = record.host_slot.view(layout.dtype, layout.span)
            if run.config.verify:
                self._verify(record, host)
            flat, record.fetch_ticket = run.backend.copy_to_device(host, pad=layout.pad)
            record.device_tensor = layout.rebuild(flat)
        record.to(State.FETCHING)

    def _materialize(self, record: Record) -> torch.Tensor:
        state = record.state
        if state in (State.RESIDENT, State.OFFLOADING, State.READY):
            if state is State.OFFLOADING:
                record.run.stats.forwarded += 1
            return record.device_tensor
        if state is State.RELEASED:
            raise RuntimeError(
                f"actoff internal error: a saved tensor of block {record.run.name!r} was "
                "unpacked after it was released"
            )
        if state is State.OFFLOADED:
            live = record.live_source()
            if live is not None:  # forwarding: the original is still alive, serve it
                record.run.stats.forwarded += 1
                return live
            if record.split is not None:
                return self._rebuild(record)
            self._fetch(record)
        run = record.run
        if record.tier == "nvme" and record.write_future is not None:
            self._finish_read(record)
        if state is State.FETCHING:  # prefetched: only a copy still in flight makes us wait
            self._account(run, "wait_ms", run.backend.stall(record.fetch_ticket))
        else:  # fetched just now: backward waits for the whole copy
            self._account(run, "wait_ms", record.fetch_ticket)
        run.backend.wait(record.fetch_ticket)
        self._account(run, "fetch_ms", record.fetch_ticket)
        # The ticket stays: Note [host slot reuse] needs it when the slot is freed.
        record.to(State.READY)
        return record.device_tensor

    def _finish_read(self, record: Record) -> None:
        run, layout = record.run, record.layout
        future, record.write_future = record.write_future, None
        try:
            future.wait(run.config.io_timeout)
            self._account_io(run, "fetch_ms", future)
        except Exception as error:  # an OSError, a timeout, or a worker that died
            if _timed_out(error):  # Note [hung I/O]: the read may still land in this buffer
                self.quarantine.append((record.host_slot, record.copy_source))
                record.host_slot = None
            raise RuntimeError(
                f"actoff: reading a saved activation of block {run.name!r} back from NVMe "
                f"failed: {error}. The step cannot continue with this activation."
            ) from error
        buffer, record.copy_source = record.copy_source, None
        if run.config.verify:
            self._verify(record, buffer)
        if run.backend.pinned:
            flat, record.fetch_ticket = run.backend.copy_to_device(buffer, pad=layout.pad)
            record.device_tensor = layout.rebuild(flat)
        else:
            record.fetch_ticket = None

    def _verify(self, record: Record, buffer: torch.Tensor) -> None:
        expected = record.checksum
        if expected is None:
            return
        actual = _crc(buffer)
        if actual != expected:
            raise RuntimeError(
                f"actoff: a saved activation of block {record.run.name!r} (tier {record.tier}, "
                f"{record.layout.nbytes} bytes) came back corrupted: checksum {actual:#010x}, "
                f"expected {expected:#010x} (ACTOFF_VERIFY=1). Check the disk and memory."
            )

    def _end_backward(self, step: Step) -> None:
        with self.lock:
            step.callback_queued = False
            for run, what, ticket in step.timings:
                ticket.synchronize()  # long done by now: backward has ended
                setattr(run.stats, what, getattr(run.stats, what) + ticket.elapsed_ms())
            step.timings.clear()
            self._decide_auto(step)
            for run in step.runs:
                for record in (*run.records, *run.children):
                    # Kept for retain_graph: drop the device copy; the host copy stays.
                    if record.state is State.READY and record.tier != "keep":
                        self._evict(record)
                run.fetch_issued = False
                run.replay_rows = None
            self.steps_completed += 1
            if not self.agreed:
                self._agree_with_rank0(step)
            self._publish(step)

    # Note [one agreement]
    # ~~~~~~~~~~~~~~~~~~~~
    # Under torch.distributed, decisions that ranks could make apart and then disagree on are
    # made by rank 0 and broadcast: the auto policy's fractions and the host arena's plan.
    # A collective is safe only at a point every rank reaches whatever its local state, or a
    # rank waits forever. The end of the first backward is such a point (every rank of a
    # data-parallel job runs it; it does not depend on lengths, budgets or timings), so the
    # agreement is one broadcast there, always, with whatever rank 0 has by then. A rank
    # installs rank 0's plan when its own first step traced the same buffers (same
    # signature) and solves nothing; a rank whose trace differs (another sequence length)
    # plans alone, as does any rank re-planning later after a divergence. Plans are offsets
    # into a rank's own arena: they never feed a collective, so ranks holding different plans
    # can not deadlock; only the entry into the broadcast must be unconditional.
    def _agree_with_rank0(self, step: Step) -> None:
        """Note [one agreement]: the first backward's end, on every rank exactly once."""
        self.agreed = True
        rank = _distributed_rank()
        if rank is None:
            return
        if rank == 0:
            self._publish(step)  # plans now (when its buffers are back), from the cache or a solve
        shared = _broadcast_from_rank0(
            {"auto": self.auto_decisions, "plans": dict(self.plans) if rank == 0 else {}}
        )
        self.auto_decisions.update(shared["auto"])  # rank 0's where it has one (a pipeline stage may not)
        if rank != 0:
            for signature, layout in shared["plans"].items():
                self.plans.setdefault(
                    signature, dataclasses.replace(layout, method=f"rank 0 ({layout.method})")
                )

    def _decide_auto(self, step: Step) -> None:
        """The auto policy, after its first step: MEMO's closed form per block. Decisions of
        the first step are replaced by rank 0's with Note [one agreement]; a block that first
        runs later is decided by its own rank (a broadcast then could wait on ranks that never
        see that block)."""
        if not any(run.auto_sample is not None and run.name not in self.auto_decisions for run in step.runs):
            return
        for run in step.runs:
            if run.auto_sample is None or run.name in self.auto_decisions:
                continue
            config = run.config
            bandwidth = config.host_bandwidth
            if bandwidth is None:
                if run.device not in self.bandwidths:
                    # Ranks on one host copy at the same time: each gets its share of the link.
                    self.bandwidths[run.device] = run.backend.host_bandwidth() / local_world_size()
                bandwidth = self.bandwidths[run.device]
            run.forward_watch.synchronize()
            input_bytes, attention_bytes, other_bytes = run.auto_sample
            self.auto_decisions[run.name] = auto_fractions(
                bandwidth_bytes_per_s=bandwidth,
                t_layer_s=run.forward_watch.elapsed_ms() / 1e3,
                input_bytes=input_bytes,
                attention_bytes=attention_bytes,
                other_bytes=other_bytes,
                num_layers=len(step.runs),
                host_budget=None if config.host_budget is None else config.host_budget // local_world_size(),
                nvme_available=config.nvme_dir is not None,
            )

    def _evict(self, record: Record) -> None:
        """READY -> OFFLOADED: drop the device copy, keep what is stored off the device."""
        if record.state is not State.READY:
            return
        if record.tier == "nvme" and record.host_slot is not None:
            record.fetch_ticket.synchronize()  # Note [host slot reuse]
            self.arena(record.run).free(record.host_slot)
            record.host_slot = None
        record.fetch_ticket = None
        record.device_tensor = None
        record.to(State.OFFLOADED)

    # ------------------------------------------------------------------ release
    def release(self, record: Record) -> None:
        """Return everything a record holds; called when autograd drops its handle."""
        with self.lock:
            state = record.state
            if state is State.RELEASED:
                return
            run = record.run
            # Copies still touching the record's memory must finish first (rare: a graph
            # freed right after forward, or a prefetch that backward never used).
            if record.copy_ticket is not None and state is State.OFFLOADING:
                record.copy_ticket.synchronize()
                self._account(run, "copy_ms", record.copy_ticket)
            if record.fetch_ticket is not None:
                # Note [host slot reuse]: the compute stream waited for the copy back, but the
                # host did not. A freed slot can be refilled at once by an NVMe read on a host
                # thread while the DMA still reads it, so the copy must be over first. It
                # almost always is: the tensor was used before its handle was dropped.
                record.fetch_ticket.synchronize()
            if record.write_future is not None:
                # The record is going away; nothing needs its bytes any more.
                try:
                    record.write_future.wait(run.config.io_timeout)
                except Exception as error:
                    if _timed_out(error):  # Note [hung I/O]
                        self.quarantine.append((record.host_slot, record.extent, record.copy_source))
                        record.host_slot = record.extent = None
            if record.host_slot is not None:
                self.arena(run).free(record.host_slot)
            if record.extent is not None:
                record.store.free(record.extent)
            record.host_slot = record.extent = record.write_future = None
            record.device_tensor = record.copy_source = None
            record.copy_ticket = record.fetch_ticket = None
            record.to(State.RELEASED)
            if record.split is not None:
                run.split_live -= 1
                if run.split_live == 0:  # nothing left to rebuild: the stored rows can go
                    run.owned.clear()
                    for child in run.children:
                        self.release(child)
            step = run.step
            step.live -= 1
            if step.live == 0 and (step.backward_started or step.aborted or self.step is not step):
                arena = self.arenas.get(run.device)
                if arena is not None:
                    arena.consolidate()

    # ------------------------------------------------------------------ helpers
    def arena(self, run: ScopeRun) -> HostArena:
        arena = self.arenas.get(run.device)
        if arena is None:
            arena = self.arenas[run.device] = HostArena(run.backend, run.config.host_budget)
        # The budget of the config in force, shared by the ranks on this host.
        budget = run.config.host_budget
        arena.budget = None if budget is None else budget // local_world_size()
        if arena.plan is None and run.config.planner != "off" and not arena.tracing:
            arena.take_trace()
            arena.tracing = True  # trace this step: the planner lays it out at its end
        return arena

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _publish(self, step: Step | None) -> None:
        if step is None or not step.runs:
            return
        self.last_stats = _collect(step)
        if step.live == 0:
            for arena in self.arenas.values():
                arena.consolidate()
            self._plan_arenas(step)

    def _plan_arenas(self, step: Step) -> None:
        """After a step whose buffers are all back: lay out the next steps (issue 5's planner).

        A traced step becomes a plan (from memory, the on-disk cache, or a solve); a step that
        diverged from its plan drops it, and the next step is traced again.
        """
        config = step.runs[0].config
        for arena in self.arenas.values():
            if arena.plan is not None and arena.divergences:
                arena.drop_plan()
                continue
            if arena.plan is not None or not arena.tracing:
                continue
            trace = arena.take_trace()
            arena.tracing = False
            if not trace or config.planner == "off":
                continue
            origin = min(start for _, start, _, _ in trace)
            buffers = [Buffer(size, start - origin, end - origin) for size, start, end, _ in trace]
            signature = hashlib.sha256(repr([dataclasses.astuple(b) for b in buffers]).encode()).hexdigest()
            layout = self.plans.get(signature)
            cache = PlanCache(config.plan_cache) if config.plan_cache else None
            key = {
                "kind": "host-arena",
                "trace": signature,
                "policy": config.policy,
                "planner": config.planner,
            }
            if layout is None and cache is not None:
                layout = cache.get(key, buffers, ALIGNMENT)
            if layout is None:
                method = "mip" if config.planner == "mip" else "greedy"
                layout = solve(buffers, method=method, time_limit_s=30.0, alignment=ALIGNMENT)
                if cache is not None:
                    cache.put(key, buffers, layout)
            self.plans[signature] = layout
            arena.plan_method = layout.method
            arena.install_plan(tuple(b.size for b in buffers), layout.offsets, layout.peak)

    def stats(self) -> Stats:
        with self.lock:
            blocks = self.last_stats
            if self.step is not None and self.step.runs and not self.step.backward_started:
                blocks = _collect(self.step)
            return Stats(
                blocks={name: _copy_stats(b) for name, b in blocks.items()},
                steps=self.steps_completed,
                host_capacity=sum(a.capacity for a in self.arenas.values()),
                host_high_water=max((a.high_water for a in self.arenas.values()), default=0),
                host_allocations=sum(a.num_allocations for a in self.arenas.values()),
                nvme_file_bytes=self.stores.file_bytes(),
                io_backend=self.stores.backend_name(),
                auto=dict(self.auto_decisions),
                host_plan=next((a.plan_method for a in self.arenas.values() if a.plan is not None), "none"),
            )

    def close(self) -> None:
        """Forget the step, statistics and host arenas; close NVMe stores (removing their files)."""
        with self.lock:
            self.step = None
            self.last_stats = {}
            self.steps_completed = 0
            self.arenas = {}  # slots still held by live graphs keep their chunk alive
            self.token_plans, self.verdicts, self._warned = {}, {}, set()
            self.auto_decisions, self.plans, self.agreed = {}, {}, False
            self.stores.close()


def _collect(step: Step) -> dict[str, BlockStats]:
    blocks: dict[str, BlockStats] = {}
    for run in step.runs:
        block = blocks.get(run.name)
        if block is None:
            block = blocks[run.name] = BlockStats(run.name, calls=0)
        source = run.stats
        block.calls += 1
        for name in (
            "dedup_hits", "skipped_param_bytes", "skipped_small_bytes", "skipped_other_bytes",
            "over_budget_bytes", "write_fallback_bytes", "forwarded", "copy_ms", "fetch_ms",
            "wait_ms", "recompute_ms",
        ):  # fmt: skip
            setattr(block, name, getattr(block, name) + getattr(source, name))
        for record in run.records:
            block.tensors += 1
            block.bytes_saved += record.layout.nbytes
            if record.split is None:
                block.bytes_per_tier[record.tier] += record.layout.nbytes
                continue
            row_bytes = record.layout.nbytes // record.split.seq_len
            block.bytes_per_tier["cpu"] += row_bytes * record.split.cpu_end
            block.bytes_per_tier["nvme"] += row_bytes * (record.split.nvme_end - record.split.cpu_end)
            block.bytes_per_tier["recompute"] += row_bytes * record.split.recompute_len
    return blocks


def _timed_out(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno == errno.ETIMEDOUT


def _rows_match(original: torch.Tensor, replayed: torch.Tensor) -> bool:
    """Recomputed rows against the real ones: equal for integers; for floats within float32
    reassociation (1e-5) or half-precision rounding (2e-2), relative to the largest value."""
    if original.shape != replayed.shape:
        return False
    if not original.is_floating_point():
        return torch.equal(original, replayed)
    tolerance = 1e-5 if original.dtype in (torch.float32, torch.float64) else 2e-2
    scale = max(float(original.abs().max()), 1.0) if original.numel() else 1.0
    return torch.allclose(replayed, original, rtol=tolerance, atol=tolerance * scale)


def _copy_stats(block: BlockStats) -> BlockStats:
    copy = BlockStats(**{k: v for k, v in vars(block).items() if k != "bytes_per_tier"})
    copy.bytes_per_tier = dict(block.bytes_per_tier)
    return copy


def _crc(tensor: torch.Tensor) -> int:
    host = tensor.detach().reshape(-1).view(torch.uint8).cpu()
    return zlib.crc32(host.numpy())


def _find_device(args: tuple, kwargs: dict, module: torch.nn.Module | None) -> torch.device:
    """The scope's device: of the first tensor argument, else of the module's parameters."""
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return item.device
        if isinstance(item, (list, tuple)):
            stack[:0] = item
        elif isinstance(item, dict):
            stack[:0] = item.values()
    if module is not None:
        for tensor in module.parameters():
            return tensor.device
    return torch.device("cpu")


_runtime: Runtime | None = None


def get_runtime() -> Runtime:
    """The process-wide runtime (created on first use)."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
    return _runtime
