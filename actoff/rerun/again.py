"""Runs again from the state a block's forward began with: `StateAtStart`, `run_again` (Note
[runs again start where the forward did] in actoff.runtime.placements.checkpoint)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from actoff.params import first_forwards, lazy

from .isolation import Found, forward_hooks_off, left_as_found
from .reached import _TORCH_OWN, Reached, _modules_of, large

__all__ = ["StateAtStart", "StateChangedError", "run_again"]


class StateChangedError(RuntimeError):
    """A block's forward wrote what a run again cannot start from as it was (Note [runs again
    start where the forward did] in actoff.runtime.placements.checkpoint)."""


class StateAtStart:
    """The state a block's forward begins with (`Found`, `Reached`: values up to 1 MiB copied),
    kept for its runs again in backward (Note [runs again start where the forward did] in
    actoff.runtime.placements.checkpoint), and the versions of its parameters and larger tensors:
    `unrestorable` names what the forward wrote that no copy was taken of (weights are too large
    to copy at every forward), and `restore` refuses what another forward wrote of it since.
    ``module`` None (a function scope): its modules are learned as its forward runs them
    (`watching`), each one's state taken before its first forward in the scope.

    >>> norm = torch.nn.BatchNorm1d(2)
    >>> start = StateAtStart(norm, [])
    >>> _ = norm(torch.randn(4, 2))
    >>> began = start.kept()
    >>> with run_again(norm, [], began):
    ...     during = int(norm.num_batches_tracked)
    >>> during, int(norm.num_batches_tracked), start.unrestorable()
    (0, 1, [])
    """

    def __init__(self, module: torch.nn.Module | None, inputs: list[Any], prefix: str = "") -> None:
        self.module = module
        self.found, self.reached = Found(module, inputs, copies=False), Reached(module, inputs)
        self.changed: bool | None = None  # the reached state's, once the forward has run
        self.large: list[tuple[weakref.ref, int]] = []  # tensors not copied: their versions
        self.parameters = [
            (name, weight, weight._version)
            for sub_name, sub in (module.named_modules(prefix=prefix) if module is not None else ())
            if not _renorms(sub)
            for name, weight in ((f"{sub_name}.{n}".lstrip("."), w) for n, w in sub._parameters.items())
            if weight is not None
        ]
        # A function scope's modules, in the order its forward first ran them, each with its state
        # then; those holding a lazy module whose parameters were not made yet, by class.
        self.parts: list[StateAtStart] = []
        self.lazy: list[str] = []

    @property
    def touched(self) -> list[torch.nn.Module]:
        """The modules a function scope's forward ran (`watching`): what its runs again may change."""
        return [part.module for part in self.parts]

    @contextlib.contextmanager
    def watching(self, each: Callable[[torch.nn.Module], None] | None = None) -> Iterator[None]:
        """Around a function scope's forward (``module`` None): each module it runs, not inside
        one it ran before, has its state taken before its first forward here and is handed to
        ``each`` (a forward pre-hook on every module, this thread's calls only). For a module
        scope, nothing to learn.

        >>> scale = torch.nn.BatchNorm1d(2)
        >>> start = StateAtStart(None, [])
        >>> with start.watching():
        ...     _ = scale(torch.randn(4, 2))
        >>> [type(module).__name__ for module in start.touched], int(scale.num_batches_tracked)
        (['BatchNorm1d'], 1)
        """
        if self.module is not None:
            yield
            return

        def taken(module: torch.nn.Module) -> None:
            if lazy(module):  # parameters still to make: no state to take, none to start from
                self.lazy.append(type(module).__name__)
            else:
                self.parts.append(StateAtStart(module, [], prefix=type(module).__name__))
            if each is not None:
                each(module)

        with first_forwards(taken):
            yield

    def unrestorable(self) -> list[str]:
        """What the forward wrote that a run again cannot start from as it was: its parameters
        (``parameter 'mlp.scale'``) and tensors over 1 MiB written in place (``tensor Block.gate``)."""
        written = [
            f"parameter {name!r}" for name, weight, version in self.parameters if weight._version != version
        ]
        written += [where for part in self.parts for where in part.unrestorable()]
        written += [
            f"module {name!r}, whose lazy parameters are made in forward (make them first: one forward without actoff)"
            for name in self.lazy
        ]
        if self.changed is None:  # asked after the forward: one walk serves `kept` too
            self.changed = self.reached.changed()
        if not self.changed:
            return written
        return written + [f"tensor {where}" for where in self.reached.written(self._copied())]

    def _copied(self) -> set[int]:
        """The tensors a run again needs no copy of, or has one: parameters and buffers up to 1 MiB."""
        skip = {id(weight) for _, weight, _ in self.parameters}
        return skip | {id(b) for sub in self.reached.modules for b in sub._buffers.values() if not large(b)}

    def kept(self) -> StateAtStart:
        """After the forward (`unrestorable` asked first, and empty): this state for the runs again,
        every copy kept (another forward of the block may change what this one did not), but not
        tensors over 1 MiB bound in its place since (an activation logged in ``self.last``)."""
        if any(large(tensor) for tensor, _ in self.reached.then.values()):
            copied = self._copied()
            self.large = [
                (weakref.ref(tensor), tensor._version)
                for _, tensor in self.reached._walk()
                if large(tensor) and id(tensor) not in copied
            ]
        self.found.trim(self.large)
        self.reached.trim(self.large)
        self.parameters = []
        for part in self.parts:
            part.kept()
        return self

    def restore(self) -> None:
        """The state as the forward began (inside a `left_as_found` that gives back today's); a
        tensor over 1 MiB another forward wrote since stops the step."""
        for ref, version in self.large:
            tensor = ref()
            if tensor is not None and tensor._version != version:
                raise StateChangedError(
                    f"actoff: a tensor of shape {list(tensor.shape)} the block reaches (not copied: over 64 KiB "
                    "and unchanged by its forward) was written in place after the forward "
                    "that a run again in backward repeats (by another forward of the block before this one's "
                    "backward): run again, it would give wrong gradients. Write it outside the forward, or "
                    "place this block with a policy that stores what it saves (cpu)."
                )
        for part in reversed(self.parts):  # a module ran inside a later one: its own state wins
            part.restore()
        self.found.restore()
        self.reached.restore()


def _renorms(module: torch.nn.Module) -> bool:
    """An embedding with ``max_norm``: it renormalises its rows in place in forward, and run
    again from them it gives the same rows (the write is not a change of state)."""
    return isinstance(module, torch.nn.Embedding) and module.max_norm is not None


@contextlib.contextmanager
def run_again(
    module: torch.nn.Module | None,
    inputs: list[Any],
    began: StateAtStart | None = None,
    name: str = "",
) -> Iterator[None]:
    """A run again of a block: from the state its forward ``began`` with (where it changed any),
    its forward hooks off, and what it changes given back (`left_as_found`, Note [re-runs leave
    no trace]); for a function scope (``module`` None), of the modules its forward ran (``began``'s
    `touched`, each checked to come to its first forward as given back: `_called_as_given_back`;
    ``name``, the block's, for its error).

    >>> layer = torch.nn.Linear(2, 2)
    >>> _ = layer.register_forward_hook(lambda *_: print("hook"))
    >>> with run_again(layer, []):
    ...     layer.seen = layer(torch.ones(2))
    >>> hasattr(layer, "seen")
    False
    """
    touched = began.touched if began is not None and module is None else []
    renorms = [sub for sub in _modules_of(module, touched) if _renorms(sub)]
    with left_as_found(module, inputs, touched):
        if began is not None:
            began.restore()  # before the hooks are lifted: it binds the modules' attributes back
        # The forward renormalised the rows it looked up, in place: looked up again as they are,
        # renormalised a second time they would move by a rounding.
        norms = [sub.max_norm for sub in renorms]
        try:
            for sub in renorms:
                sub.max_norm = None
            with forward_hooks_off(module, touched), _called_as_given_back(began if touched else None, name):
                yield
        finally:
            for sub, norm in zip(renorms, norms, strict=True):
                sub.max_norm = norm


@contextlib.contextmanager
def _called_as_given_back(began: StateAtStart | None, name: str) -> Iterator[None]:
    """Around a function scope's run again, its modules given back the state each had at its first
    forward in the scope (``began``'s parts): each must come to its first forward here as given
    back. What wrote it before (the scope's own code, ``self.norm.weight.mul_(0.5)`` or
    ``self.norm.eps *= 2`` before ``self.norm(x)``, or a module it ran before) would write it once
    more now, and the module would run on another state than the forward's: wrong gradients
    without a word. An in-place write into a parameter, buffer or tensor attribute of a module not
    yet run here stops the step before it lands (`_GuardedWrites`: the model keeps the forward's
    values); what the guard cannot see (a write from C++, an attribute bound anew to another value)
    is caught at the module's first forward (`_Given`), after it landed. What a module that ran
    writes of its own (a BatchNorm shared by two modules) is its forward's, as in the forward
    (Note [runs again start where the forward did] in actoff.runtime.placements.checkpoint)."""
    if began is None:
        yield
        return
    given = {id(part.module): _Given(part.module) for part in began.parts}
    guard = _GuardedWrites(name)
    for state in given.values():
        for where, _, _, storage in state.tensors:
            if storage is not None:
                guard.guarded.setdefault(storage, where)

    def called(module: torch.nn.Module) -> None:
        with torch._C.DisableTorchFunction():  # its own reads: not through the guard
            state = given.pop(id(module), None)
            where = state.changed() if state is not None else None
            if where is not None:
                raise _written(name, where)
            ran = state if state is not None else _Given(module)  # what it owns, less what ran before
            for _, _, _, storage in ran.tensors:
                guard.guarded.pop(storage, None)
            for other in given.values():
                other.forget(ran)
        if not guard.guarded:
            guard.lift()

    with first_forwards(called), guard:
        yield


class _Given:
    """A module's state as a run again gave it back, to compare at its first forward there: the
    versions of its parameters, buffers and tensor attributes (and their storages, for the guard),
    what each attribute of its submodules is bound to (torch's own left out: ``training``), and
    the items of the dictionaries and lists they hold (LoRA's ``scaling["default"]``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        prefix = type(module).__name__
        self.tensors: list[tuple[str, torch.Tensor, int, int | None]] = []
        self.bindings: list[tuple[str, torch.nn.Module, Any, Any, Any]] = []
        for sub_name, sub in module.named_modules():
            where = f"{prefix}.{sub_name}".rstrip(".")
            for table, skip in ((vars(sub), _TORCH_OWN), (sub._parameters, ()), (sub._buffers, ())):
                for key, value in table.items():
                    if key in skip:
                        continue
                    self._note(f"{where}.{key}", sub, table, key, value)
                    if type(value) in (dict, list):
                        items = value.items() if type(value) is dict else enumerate(value)
                        for index, item in items:
                            self._note(f"{where}.{key}[{index!r}]", sub, value, index, item)

    def _note(self, where: str, sub: torch.nn.Module, table: Any, key: Any, value: Any) -> None:
        self.bindings.append((where, sub, table, key, value))
        if isinstance(value, torch.Tensor):
            self.tensors.append((where, value, value._version, _storage(value)))

    def changed(self) -> str | None:
        """What was written since, by name (``LayerNorm.weight``), or None."""
        for where, tensor, version, _ in self.tensors:
            if tensor._version != version:
                return where
        for where, _, table, key, value in self.bindings:
            now = (
                (table[key] if key < len(table) else _GONE) if type(table) is list else table.get(key, _GONE)
            )
            if now is not value and not _same_value(now, value):
                return where
        return None

    def forget(self, ran: _Given) -> None:
        """Leave out what belongs to the module that ``ran``: its forward's to write (a module
        shared by two others, run in the first; a dictionary both hold)."""
        storages = {storage for _, _, _, storage in ran.tensors if storage is not None}
        subs = {id(sub) for _, sub, _, _, _ in ran.bindings}
        # A dictionary or list it holds, another module may hold too (a state both count in).
        held = {id(value) for *_, value in ran.bindings if type(value) in (dict, list)}
        self.tensors = [entry for entry in self.tensors if entry[3] not in storages]
        self.bindings = [
            entry for entry in self.bindings if id(entry[1]) not in subs and id(entry[2]) not in held
        ]


_GONE = object()


def _same_value(now: Any, then: Any) -> bool:
    """Whether an attribute bound anew holds what it held: a number, string or None equal, a
    tensor up to 1 MiB equal (a mask made again from the same input); anything else is not."""
    if isinstance(now, torch.Tensor) and isinstance(then, torch.Tensor):
        return (
            now.shape == then.shape
            and now.dtype == then.dtype
            and now.device == then.device
            and not large(now)
            and bool(torch.equal(now, then))
        )
    plain = (int, float, bool, str, type(None))
    return isinstance(now, plain) and type(now) is type(then) and now == then


def _written(name: str, where: str) -> StateChangedError:
    block = f"block {name!r}" if name else "a function scope"
    return StateChangedError(
        f"actoff: {block} wrote '{where}' before running that module, and would write it again in the "
        "run again, which would run the module on another value than the forward did and give wrong "
        "gradients. Write it inside the module's forward, or decorate the module itself with "
        "@actoff.offload (its state is then taken before the write)."
    )


class _GuardedWrites(TorchFunctionMode):
    """Stops an in-place write (``mul_``, ``copy_``, ``x[i] = v``, ``out=``, ``.data =``) into a
    ``guarded`` storage (by address: ``.data`` views too) before it lands."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.guarded = name, {}  # storage address: what it is, by module class and name
        self.lifted = False

    def lift(self) -> None:
        """Off the mode stack once nothing is guarded, where it is on top (a mode costs every
        operation after it a call into Python)."""
        stack = torch._C._len_torch_function_stack()
        if not self.lifted and stack and torch._C._get_function_stack_at(stack - 1) is self:
            torch._C._pop_torch_function_stack()
            self.lifted = True

    def __exit__(self, *exc: object) -> None:
        if not self.lifted:
            super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.guarded:
            out = kwargs.get("out")
            targets = list(out) if isinstance(out, list | tuple) else [out]
            if args and _writes(func):
                targets += args[0] if isinstance(args[0], list | tuple) else [args[0]]
            for target in targets:
                storage = _storage(target) if isinstance(target, torch.Tensor) else None
                where = self.guarded.get(storage) if storage is not None else None
                if where is not None:
                    raise _written(self.name, where)
        return func(*args, **kwargs)


_IN_PLACE = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"})
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "rename_"})  # in-place on metadata only


def _writes(func: Any) -> bool:
    """Whether ``func`` writes into its first argument: an in-place method (``mul_``, not
    ``requires_grad_``), an in-place operator, item assignment, or ``.data =``.

    >>> _writes(torch.Tensor.mul_), _writes(torch.Tensor.mul), _writes(torch.Tensor.requires_grad_)
    (True, False, False)
    """
    op = getattr(func, "__name__", "")
    if op == "__set__":  # a property set: ``.data =`` rebinds the values, ``.grad =`` does not
        return getattr(getattr(func, "__self__", None), "__name__", "") == "data"
    return op in _IN_PLACE or (op.endswith("_") and not op.endswith("__") and op not in _NOT_WRITES)


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage; None where it has none to guard (empty, meta, or no
    storage to read: a tensor subclass that wraps others, a sparse tensor)."""
    try:
        return tensor.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None
