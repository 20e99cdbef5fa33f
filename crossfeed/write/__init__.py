"""Writing: the dataset writer and commit, and adoption of existing TFRecord shards."""
