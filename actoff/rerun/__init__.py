"""Running a block again: what every placement that re-runs a block in backward needs, whatever it
keeps of the block (token-wise rows rebuilt on a token slice, a checkpointed block run whole).

- `isolation`: what a re-run leaves as it found it: caches, buffers, attributes, forward hooks.
- `dropout`: the forward's dropout masks drawn again in a re-run.
- `state`: the forward's grad mode and autocast, and each input's part in autograd.
- `conditions`: a block call flattened, and the key of what decides what it saves.
"""
