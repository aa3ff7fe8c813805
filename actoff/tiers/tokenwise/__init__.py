"""Token-wise placement: a block's saved activations split by token range, the rest rebuilt.

A slice of a block's input gives the same slice of every token-local activation; only the
token mixer (attention) needs every token. So the rows a run does not store are recomputed
in backward by re-running the block on those rows, with the mixer's output served from what
forward stored. The placement that drives it is actoff.runtime.placements.tokenwise.

- `split`: a scope run's token-wise state (`Split`): what a re-run needs, the ranges, the
  records it splits.
- `tier`: the stateless token-wise tier: stored rows gathered and copied out, split records
  rebuilt in backward, the probe run.
- `slices`: the block re-run on a token slice: the probe in a block's first backward and the
  recompute of dropped rows in backward.
- `sentinels`: rows kept every step to check each recompute before it is used.
- `probes`: what a probe learned about a module, per module and per conditions.
- `mixers`: the registry of token mixers and the modes that see or serve them.
- `tokens`: token dimensions of saved tensors and token ranges (pure functions).
- `rows`, `rows_triton`: token rows gathered into one staging buffer and scattered back.
"""
