"""The nvme tier: records in one preallocated file per process, read back for backward.

- `tier`: the tier itself (staged through host memory, or straight from the device).
- `store`: the file and its 4 KiB-aligned extents, reused across steps.
- `files`: the file itself: opened with no name on disk, safely, and what dead processes left
  reclaimed.
- `seals`: every record sealed when written (CRC32C of its sequence number, length and bytes)
  and checked when read.
- `engines`: the I/O engine interface, the C++ POSIX engine and its pure-Python twin.
- `kvikio`: kvikio's ``CuFile`` behind the same interface (GPUDirect Storage where real).
"""
