"""The files the nvme tier creates: exclusively, never through a symlink, readable by the owner
only, and for spill files without a name on disk, so that they die with the process.

Note [spill files die with the process]: a spill file holds activations (a model's inputs, in
effect) and may be large. Removing it in exit handlers fails whenever the process dies
without running them (SIGKILL, the OOM killer, a crash), and a directory shared by several
users lets a planted symlink redirect a file opened by name. So every file is created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, and a spill file is opened with
``O_TMPFILE`` (no name at all) where the file system has it, else created under its name and
unlinked at once: the engines work on descriptors only (the C++ engine and kvikio reopen
``/proc/self/fd/N`` for ``O_DIRECT``), so the kernel frees the blocks when the last
descriptor closes, however the process ends. For the instant between creating a named file
and unlinking it, `reclaim_dead` removes at start the files whose process (the pid in the
name) no longer exists.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import os
import re

__all__ = ["SpillFile", "create_exclusive", "reclaim_dead"]

#: What actoff names its files, with the pid of the process that made them.
_OURS = re.compile(r"^(?:actoff-rank[^-/]*-pid(\d+)-[0-9a-f]+\.bin|\.actoff-probe-(\d+)-\d+)$")

_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TMPFILE = getattr(os, "O_TMPFILE", 0)


def create_exclusive(path: str) -> int:
    """A new file at ``path`` (mode 0600), opened read-write; raises ``FileExistsError`` if
    anything, a symlink included, is already there."""
    return os.open(path, _CREATE, 0o600)


class SpillFile:
    """An open file the nvme tier created, by descriptor. ``path`` is the name it was created
    under (for messages: it may have none on disk now), ``label`` says so.

    >>> import tempfile
    >>> spill = SpillFile.anonymous(tempfile.mkdtemp(), "actoff-rank0-pid1-ab.bin")
    >>> spill.named, spill.size(), spill.label.endswith("(unlinked)")
    (False, 0, True)
    >>> spill.close()
    """

    def __init__(self, fd: int, path: str, *, named: bool) -> None:
        self.fd = fd
        self.path = path
        self.directory = os.path.dirname(path) or "."
        self.named = named  # False: nothing in the directory refers to it

    @property
    def label(self) -> str:
        return self.path if self.named else f"{self.path} (unlinked)"

    @classmethod
    def anonymous(cls, directory: str, name: str, *, tmpfile: bool = True) -> SpillFile:
        """A file in ``directory`` that has no name there (Note [spill files die with the
        process]); ``name`` appears in messages only. ``tmpfile=False`` skips ``O_TMPFILE``."""
        path = os.path.join(directory, name)
        if tmpfile and _TMPFILE:
            try:
                # O_EXCL: it can never be given a name later (linkat) either.
                flags = os.O_RDWR | _TMPFILE | os.O_EXCL | os.O_CLOEXEC
                return cls(os.open(directory, flags, 0o600), path, named=False)
            except OSError as error:  # a file system without O_TMPFILE: a name, unlinked at once
                if error.errno not in (errno_codes.EOPNOTSUPP, errno_codes.EISDIR, errno_codes.EINVAL):
                    raise
        fd = create_exclusive(path)
        with contextlib.suppress(FileNotFoundError):  # reclaimed already by another process
            os.unlink(path)
        return cls(fd, path, named=False)

    @classmethod
    def open(cls, path: str) -> SpillFile:
        """The file the caller names (benchmarks, tests): opened without following a symlink,
        created exclusively (mode 0600) when missing; it keeps its name."""
        try:
            return cls(os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC), path, named=True)
        except FileNotFoundError:
            return cls(create_exclusive(path), path, named=True)

    def reopen_path(self) -> str:
        """A path that opens this very file again, named or not (Linux: /proc/self/fd)."""
        return f"/proc/self/fd/{self.fd}"

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def reclaim_dead(directory: str) -> list[str]:
    """Remove actoff's files in ``directory`` whose process no longer exists (the pid in the
    name answers ESRCH); returns their names. Files of live processes, of other users (EPERM)
    and of this process stay."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _OURS.match(name)
        if match is None:
            continue
        pid = int(match.group(1) or match.group(2))
        if pid <= 0 or pid == os.getpid() or _alive(pid):  # kill(0, ...) means the group
            continue
        with contextlib.suppress(OSError):  # gone already, or not ours to remove
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
