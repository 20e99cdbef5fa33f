"""Child-process entry points and helpers of the metrics and `crossfeed top` tests."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PROMETHEUS = Path("/usr/bin/prometheus")
METRICS_LINE = re.compile(r"metrics \(Prometheus, unauthenticated HTTP\) on http://127\.0\.0\.1:(\d+)/metrics")


def spawn(entry: str, *args, log: Path) -> subprocess.Popen:
    """`metrics_helpers.entry(*args)` in a fresh interpreter; stdout+stderr go to `log`."""
    code = f"import metrics_helpers; metrics_helpers.{entry}(*{list(args)!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_port(log: Path) -> int | None:
    """The port a `--metrics 127.0.0.1:0` process logged, once it has."""
    m = METRICS_LINE.search(log.read_text()) if log.exists() else None
    return int(m.group(1)) if m else None


def watched_trainer(dispatcher: str, out_file: str, port_file: str, release_file: str) -> None:
    """A trainer with `crossfeed.metrics.serve`: reads until the dispatcher's epochs are done
    through `Endpoint.watch` (rank 0), writes one JSON line of sample ids per batch, then keeps
    its metrics up until `release_file` exists (at most 120 s)."""
    import logging

    import crossfeed.metrics
    from crossfeed import connect

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    endpoint = crossfeed.metrics.serve(0)
    Path(port_file).write_text(str(endpoint.port))
    with open(out_file, "a", buffering=1) as out:
        stream = connect(
            dispatcher=dispatcher, credits=2, heartbeat_interval=0.1, heartbeat_timeout=1.5, connect_timeout=10.0
        )
        with stream:
            for batch in endpoint.watch(stream, rank=0):
                out.write(json.dumps(batch["label"].tolist()) + "\n")
        out.write("END\n")
    deadline = time.monotonic() + 120
    while not Path(release_file).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    endpoint.close()


def prometheus_query(port: int, query: str) -> list[dict]:
    """The result vector of an instant query at the Prometheus server on `port` ([] if it is not up yet)."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
    except OSError:
        return []
    assert body["status"] == "success", body
    return body["data"]["result"]


def start_prometheus(tmp_path: Path, targets: list[int]) -> tuple[subprocess.Popen, int]:
    """Debian's prometheus scraping `targets` (localhost ports) every second; (process, its port)."""
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: crossfeed\n    scrape_interval: 1s\n    scrape_timeout: 900ms\n"
        "    static_configs:\n      - targets: [" + ", ".join(f"'127.0.0.1:{p}'" for p in targets) + "]\n"
    )
    port = free_port()
    argv = [
        str(PROMETHEUS),
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with open(tmp_path / "prometheus.log", "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT), port
