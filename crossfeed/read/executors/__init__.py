"""Stage 6 of the read pipeline, the executor: `threads` (the default), `processes` (worker processes filling shared-memory `slots`; each runs `worker`)."""
