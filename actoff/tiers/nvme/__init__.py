"""The nvme tier: records in one preallocated file per process, read back for backward.

- `tier`: the tier itself (staged through host memory, or straight from the device).
- `store`: the file and its 4 KiB-aligned extents, reused across steps.
- `engines`: the I/O engine interface, the C++ POSIX engine and its pure-Python twin.
- `kvikio`: kvikio's ``CuFile`` behind the same interface (GPUDirect Storage where real).
"""
