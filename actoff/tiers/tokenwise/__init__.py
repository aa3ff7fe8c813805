"""Token-wise placement: a block's saved activations split by token range, the rest rebuilt.

A slice of a block's input gives the same slice of every token-local activation; only the
token mixer (attention) needs every token. So the rows a run does not store are recomputed
in backward by re-running the block on those rows, with the mixer's output served from what
forward stored.

- `run`: a scope run's token-wise state, its split records and their placement.
- `reforward`: the re-forward on a token slice: the probe in a block's first backward and the
  recompute of dropped rows in backward.
- `isolation`: what a re-forward leaves as it found it: caches, buffers, attributes, hooks.
- `dropout`: the forward's dropout masks drawn again in a re-forward.
- `sentinels`: rows kept every step to check each recompute before it is used.
- `probes`: what a probe learned about a module, per module and per conditions.
- `mixers`: the registry of token mixers and the modes that see or serve them.
- `tokens`: token dimensions of saved tensors and token ranges (pure functions).
- `pack`, `pack_triton`: gathering token rows into one staging buffer and back.
"""
