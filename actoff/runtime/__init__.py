"""One training step: the pack and unpack hooks, scope runs, placement, backward and release.

- `hooks`: what autograd holds for a saved tensor (a handle to a record, or the tensor
  kept as is) and the unpack hook that gives it back.
- `step`: a `Step` (the scope runs of one forward, until its backward ends) and a `ScopeRun`
  (one call of an offload scope, its records and its pack hook).
- `runtime`: the process's `Runtime`: it drives scope runs through placement, prefetch in
  backward and release at the end of the step.
- `auto`: the auto policy: blocks measured, planned under the device budget, checked every step.
- `measured`: what the auto policy measures of a block, under its key (module and conditions).
- `checkpoint`: the checkpoint placement: a block's inputs stored, the block run again in backward.
- `enclosing`: scopes under activation checkpointing: other saved-tensor hooks around a scope,
  and calls during backward.
- `lock`: the runtime's lock, and releases deferred from the garbage collector.
- `stats`: per-block figures of the last step (`actoff.stats()`).
- `distributed`: rank facts, and the one agreement with rank 0's decisions.
"""
