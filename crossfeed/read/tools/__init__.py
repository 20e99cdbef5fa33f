"""Tools over the read pipeline: `verify` (every byte against the manifest; `verify_tar` for tar shards; `problem` is what they report) and `profile` (`crossfeed bench`)."""
