"""Reading: storage, datasets and splits, the epoch plan, the staged Loader (plan → frames → decode → batch), verification, benchmarking."""
