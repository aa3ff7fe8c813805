"""Tiled compute: bounding the working memory of token-local modules and of the loss.

- `tile`: `tile_` runs an MLP, a norm or a projection chunk by chunk along the tokens.
- `loss`: `chunked_cross_entropy` and `chunked_loss_`: the LM head and its loss without the
  full logits.
- `chunking`: token chunks and the forward-time state (autocast, RNG) a chunk's recompute restores.
"""
