"""Child-process entry points and helpers of the dispatcher tests (`tests/test_net_dispatch.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
HB = ["--heartbeat-interval", "0.1", "--heartbeat-timeout", "1.5"]


def spawn(entry: str, *args, log: Path) -> subprocess.Popen:
    """`dispatch_helpers.entry(*args)` in a fresh interpreter; stdout+stderr go to `log`."""
    code = f"import dispatch_helpers; dispatch_helpers.{entry}(*{list(args)!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env)


def cli(*argv: str) -> None:
    from crossfeed.cli.main import app

    app(["--verbose", *argv], prog_name="crossfeed")


def write_dataset(path: str, n: int) -> None:
    import numpy as np

    import crossfeed

    samples = [{"x": np.full((4,), i, np.int64), "label": i} for i in range(n)]
    crossfeed.write_dataset(path, samples, num_shards=3).close()


def tag_sample(sample: dict) -> dict:
    """A module-level transform (`--transform dispatch_helpers:tag_sample`): the label + 1000,
    and where it ran: the process id, and 1 in a Loader pool thread ("crossfeed-loader_N")."""
    import threading

    import numpy as np

    pooled = threading.current_thread().name.startswith("crossfeed-loader")
    return {**sample, "label": sample["label"] + 1000, "pid": np.int64(os.getpid()), "pooled": np.int64(pooled)}


def trainer(dispatcher: str, out_file: str, pace: float = 0.0, keys: str = "", fields: bool = False) -> None:
    """One JSON line of sample ids per batch (flushed before the next is asked for), then END;
    `fields`: each line also has the batch's label, pid and pooled columns (see `tag_sample`)."""
    import logging

    from crossfeed import connect

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    with (
        open(out_file, "a", buffering=1) as out,
        connect(
            dispatcher=dispatcher,
            keys=keys or None,
            credits=2,
            with_meta=True,
            heartbeat_interval=0.1,
            heartbeat_timeout=1.5,
            connect_timeout=10.0,
        ) as c,
    ):
        for meta, batch in c:
            line = [meta.sample_ids.tolist(), meta.server_id]
            if fields:
                line.append({k: batch[k].tolist() for k in ("label", "pid", "pooled")})
            out.write(json.dumps(line) + "\n")
            out.flush()
            if pace:
                time.sleep(pace)
        out.write(f"END {c.refused} {c.duplicates}\n")


def read_batches(path: Path) -> list[tuple[list[int], str]]:
    if not path.exists():
        return []
    return [tuple(json.loads(line)[:2]) for line in path.read_text().splitlines() if line.startswith("[")]


def read_fields(path: Path) -> list[tuple[list[int], str, dict]]:
    """The lines of a `trainer(..., fields=True)`: (sample ids, server id, columns)."""
    return [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.startswith("[")]
