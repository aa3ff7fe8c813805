"""One training step: the pack and unpack hooks, scope runs, placements, backward and release.

- `runtime`: the thread's `Runtime`: it drives every scope run along one path, through its
  placement, prefetch in backward and release at the end of the step.
- `step`: a `Step` (the scope runs of one forward, until its backward ends) and a `ScopeRun`
  (one call of an offload scope: its records, its pack hook, its fetches in backward, and the
  view of it the tiers see).
- `hooks`: what autograd holds for a saved tensor (a handle to a record, or the tensor kept as
  is) and the unpack hook that gives it back.
- `placements/`: what a run's saved tensors become, a class per kind behind one interface
  (Note [placements]): whole, kept, token-wise, checkpoint.
- `auto`: the auto policy, an observer of the steps: each run's placement from its plan, the
  runs measured; `planning`: its plans made, checked and replanned; `measured`: what it
  measures of a block and of a run, under the block's key (module and conditions).
- `enclosing`: scopes under activation checkpointing: other saved-tensor hooks around a scope,
  and calls during backward.
- `arguments`: the device a scope call runs on.
- `lock`: the runtime's lock, and releases deferred from the garbage collector.
- `stats`: per-block figures of the last step (`actoff.stats()`).
- `distributed`: rank facts, and the one agreement with rank 0's decisions.
"""
