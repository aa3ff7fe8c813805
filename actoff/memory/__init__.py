"""Planned memory: arenas allocated once and served at planned offsets, so nothing fragments.

- `host_arena`: host memory (pinned on CUDA) handed out as aligned slots, at planned offsets
  once the host arena has a plan; `host_plans` keeps one plan per shape of step, and
  `host_chunks` sizes its chunks as the host allocator holds them.
- `device_arena`: the device buffers actoff allocates in backward (fetch destinations,
  token-wise rebuilds), served from a few buffers at planned offsets; `device_plans` keeps
  one plan per shape of step.
- `arenas`: the process's arenas, and the path from the buffers a step traced to a plan
  installed in an arena (through `actoff.planner`).
- `replay_allocator` and `replay_steps`: the opt-in CUDA allocator that replays each step's
  allocations at planned offsets (``ACTOFF_ALLOCATOR=replay``).
"""
