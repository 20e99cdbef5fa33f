"""Shared fixtures: small generated datasets in tmp_path and a helper to run Python in a fresh
process (for checks that need an interpreter of their own, e.g. what `import crossfeed` pulls in)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest


def mixed_samples(n: int, seed: int = 0) -> list[dict]:
    """Samples covering the common encodings: a raw tensor, int64/float scalars and lists, str."""
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.integers(0, 255, (4, 5, 3), dtype=np.uint8),
            "label": int(i),
            "score": np.float32(i / 7),
            "tokens": list(range(i % 4)),
            "name": f"sample-{i}",
        }
        for i in range(n)
    ]


@pytest.fixture
def mixed_dataset(tmp_path):
    """A 3-shard dataset of 30 `mixed_samples`; returns ``(path, samples)``."""
    import crossfeed

    samples = mixed_samples(30)
    root = tmp_path / "mixed"
    crossfeed.write_dataset(root, samples, num_shards=3).close()
    return root, samples


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; fails the test with its stderr when it exits non-zero."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        pytest.fail(f"subprocess exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture
def options_data(tmp_path):
    """The two-split dataset of the options-path tests (`options_helpers`)."""
    from options_helpers import write

    return write(tmp_path / "options-data")
