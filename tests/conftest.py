"""Shared fixtures: small generated datasets in tmp_path and a helper to run Python in a fresh
process (for checks that need an interpreter of their own, e.g. what `import crossfeed` pulls in)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import numpy as np
import pytest


class lazy_import:  # noqa: N801 (used like a module)
    """A module imported on its first attribute use, so that collecting a test module costs no
    TensorFlow, torch or Beam import (``tf = lazy_import("tensorflow")`` at the top, ``tf.constant``
    in a test); a test that uses a module not installed is skipped, as `pytest.importorskip` would."""

    def __init__(self, name: str):
        self.__name = name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # what collection asks of every name (`_mock_name`, `__test__`): no import
            raise AttributeError(attr)
        module = sys.modules.get(self.__name) or pytest.importorskip(self.__name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy_import {self.__name!r}>"


def requires(*names: str):
    """Skip a test (or, as ``pytestmark``, a test module) unless every module named is installed,
    without importing any: collection stays cheap."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


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
