"""Tiers: where a record's bytes live between forward and backward, and every move they make.

A saved tensor becomes a `record.Record` with a checked state machine. Its tier places it at
the end of its block's forward, fetches it for backward and releases it:

- `base`: the `Tier` interface and `KEEP` (the bytes stay on the device).
- `cpu`: a host arena slot (pinned memory on CUDA), copied off the compute stream.
- `nvme/`: the process's spill file, through the C++ POSIX engine or kvikio.
- `tokenwise/`: a block's activations split by token range between cpu, nvme and
  recompute; the dropped rows are rebuilt in backward by re-running the block on them.
- `registry`: the whole-tensor tiers by name (the policy table's tier names).
- `run_view`: what a tier sees of the run that saved a record (Note [tiers see a view of their run]).
- `record`: a record, its state machine and how its bytes are copied and rebuilt.
"""
