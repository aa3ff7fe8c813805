"""Offload scopes: which calls actoff manages.

- `offload`: `offload` (a class, an instance or a function), `offload_` (every matching
  submodule, in place) and `no_offload` (an opt-out region).
- `compile`: an offload scope under ``torch.compile``: a graph break around the compiled body.
"""
