"""Where bytes live (layer 2, above `format`): local files (`files`: mmap, GZIP streams, sha256), local or fsspec storage (`storage`), and the bounded shard cache (`cache`)."""
