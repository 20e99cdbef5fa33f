"""Writing (layer 3, beside `read`): `writer` (`write_dataset`), `staging` and `commit` (the atomic commit protocol), and `adopt/` (adopting data other tools wrote)."""
