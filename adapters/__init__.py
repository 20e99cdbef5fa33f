"""Framework adapters: `crossfeed.adapters.tf` (tf.data), `crossfeed.adapters.torch` (IterableDataset)
and `crossfeed.adapters.jax` (global jax.Array batches).
Each imports only its own framework."""
