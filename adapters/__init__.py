"""Framework adapters: `crossfeed.adapters.tf` (tf.data) and `crossfeed.adapters.torch` (IterableDataset).
Each imports only its own framework."""
