"""Shared pieces of the network tests: synthetic batches, child processes, bounded waits.

Child processes run `python -c "import net_helpers; net_helpers.<entry>(...)"`; every entry
point here is what such a child runs.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FAST_HB = {"heartbeat_interval": 0.1, "heartbeat_timeout": 2.0, "connect_timeout": 15.0}


class Synthetic:
    """factory(epoch) -> batches of `num_samples` samples; ids 0..n-1, values derived from ids."""

    def __init__(self, num_samples: int = 64, batch_size: int = 8, shape=(4,), delay: float = 0.0, offset: int = 0):
        self.num_samples, self.batch_size, self.shape = num_samples, batch_size, tuple(shape)
        self.delay, self.offset = delay, offset

    def __call__(self, epoch: int):
        ids = np.arange(self.num_samples, dtype=np.int64) + self.offset
        for start in range(0, self.num_samples, self.batch_size):
            if self.delay:
                time.sleep(self.delay)  # test pacing only: makes "mid-epoch" last long enough
            chunk = ids[start : start + self.batch_size]
            x = np.broadcast_to(chunk.reshape((-1,) + (1,) * len(self.shape)), (len(chunk),) + self.shape)
            yield {
                "x": np.ascontiguousarray(x, dtype=np.float32),
                "label": (chunk % 10).astype(np.int64),
                "name": [f"s{i}" for i in chunk],
                "__index__": chunk,
            }


def child(entry: str, *args, log: Path) -> subprocess.Popen:
    """Start `net_helpers.entry(*args)` in a fresh interpreter; stdout+stderr go to `log`."""
    code = f"import net_helpers; net_helpers.{entry}(*{list(args)!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    out = open(log, "wb")
    try:
        return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env)
    finally:
        out.close()


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def wait_until(predicate, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise AssertionError(f"child exited with {p.returncode} while waiting for {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_endpoint(path: Path, timeout: float = 20.0, procs=()) -> str:
    return wait_until(lambda: path.exists() and path.read_text().strip(), timeout, f"endpoint in {path}", procs)


def serve_child(tmp_path: Path, dataset: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    """A `crossfeed serve DATASET tcp://127.0.0.1:0 --batch-size 6 …extra` child (fast heartbeats),
    logging to ``tmp_path/serve.log``; ``(process, the file its endpoint is written to)``."""
    ep = tmp_path / "ep"
    proc = child(
        "cli",
        "serve",
        dataset,
        "tcp://127.0.0.1:0",
        "--batch-size",
        "6",
        "--heartbeat-interval",
        "0.1",
        "--heartbeat-timeout",
        "2",
        "--endpoint-file",
        str(ep),
        *extra,
        log=tmp_path / "serve.log",
    )
    return proc, ep


def served_batches(proc: subprocess.Popen, endpoint_file: Path, log: Path) -> list[tuple]:
    """``(epoch, sample ids, labels, first pixel of each image)`` of every batch a `crossfeed serve`
    child streams (read through `crossfeed.net.connect`), after the child has exited cleanly."""
    from crossfeed.net import connect

    try:
        address = read_endpoint(endpoint_file, procs=[proc])
        with connect(address, with_meta=True, **FAST_HB) as client:
            got = [
                (m.epoch, m.sample_ids.tolist(), b["label"].tolist(), b["image"][:, 0, 0, 0].tolist())
                for m, b in client
            ]
        assert proc.wait(30) == 0, log.read_text()
    finally:
        stop(proc)
    return got


def served_rows(tmp_path: Path, source, row) -> list:
    """``row(meta, batch)`` of every batch a `crossfeed serve SOURCE tcp://127.0.0.1:0 --batch-size 4
    --epochs 2 --seed 3 --threads 1` child streams (fast heartbeats; read through
    `crossfeed.net.connect`), after the child has exited cleanly (its log: ``tmp_path/serve.log``)."""
    from crossfeed.net import connect

    ep, log = tmp_path / "ep", tmp_path / "serve.log"
    proc = child(
        "cli", "serve", str(source), "tcp://127.0.0.1:0", "--batch-size", "4", "--epochs", "2", "--seed", "3",
        "--threads", "1", "--heartbeat-interval", "0.1", "--heartbeat-timeout", "2", "--endpoint-file", str(ep),
        log=log,
    )  # fmt: skip
    try:
        with connect(read_endpoint(ep, procs=[proc]), with_meta=True, **FAST_HB) as client:
            got = [row(m, b) for m, b in client]
        assert proc.wait(30) == 0, log.read_text()
    finally:
        stop(proc)
    return got


def read_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if line]


def batches_in(path: Path) -> list[list[int]]:
    return [json.loads(line) for line in read_lines(path) if line.startswith("[")]


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---- child entry points ------------------------------------------------------------------


def run_server(
    endpoint_file: str,
    address: str,
    num_samples: int,
    batch_size: int,
    epochs,
    delay: float = 0.0,
    broadcast: str = "",
    shape=(4,),
    offset: int = 0,
) -> None:
    import logging

    from crossfeed.net import Heartbeat, Server, ServerOptions

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    opts = ServerOptions(
        (address,),
        broadcast=(broadcast,) if broadcast else (),
        epochs=epochs,
        heartbeat=Heartbeat(FAST_HB["heartbeat_interval"], FAST_HB["heartbeat_timeout"]),
    )
    with Server(Synthetic(num_samples, batch_size, shape, delay, offset), opts) as server:
        _write_atomic(endpoint_file, " ".join(server.endpoints + server.broadcast_endpoints))
        server.wait()
        server.raise_if_failed()


def run_trainer(addresses, out_file: str, stall_after=None, credits: int = 4) -> None:
    """Consume batches, one JSON line of sample ids per batch (flushed before the next is asked
    for); after `stall_after` batches, hold the last one forever (until killed)."""
    import logging

    from crossfeed.net import connect

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    with open(out_file, "a", buffering=1) as out, connect(addresses, credits=credits, with_meta=True, **FAST_HB) as c:
        for n, (meta, _batch) in enumerate(c, 1):
            out.write(json.dumps(meta.sample_ids.tolist()) + "\n")
            out.flush()
            if stall_after is not None and n >= stall_after:
                while True:
                    time.sleep(1)
        out.write("END " + json.dumps([lost.address for lost in c.lost]) + "\n")


def cli(*argv: str) -> None:
    """The real `crossfeed` command (its one error boundary included), with INFO logs."""
    from crossfeed.cli.main import app

    app(["--verbose", *argv], prog_name="crossfeed")


def write_image_dataset(path: str, n: int = 20) -> None:
    import crossfeed

    samples = [{"image": np.full((8, 8, 3), i, np.uint8), "label": i} for i in range(n)]
    crossfeed.write_dataset(path, samples, num_shards=2).close()


def add_hundred(sample: dict) -> dict:
    """A `--transform` for the CLI test."""
    return {**sample, "label": sample["label"] + 100}


def run_server_with(endpoint_file: str, spec: dict) -> None:
    """A server from a JSON-able `spec`: address, num_samples, batch_size, epochs, delay,
    keys (a CURVE server key directory), progress_timeout, heartbeat [interval, timeout]."""
    import logging

    from crossfeed.net import Heartbeat, Server, ServerKeys, ServerOptions

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    hb = spec.get("heartbeat", [FAST_HB["heartbeat_interval"], FAST_HB["heartbeat_timeout"]])
    opts = ServerOptions(
        (spec["address"],),
        epochs=spec.get("epochs", 1),
        heartbeat=Heartbeat(*hb),
        progress_timeout=spec.get("progress_timeout", 300.0),
    )
    keys = ServerKeys.from_dir(spec["keys"]) if spec.get("keys") else None
    factory = Synthetic(spec.get("num_samples", 40), spec.get("batch_size", 4), delay=spec.get("delay", 0.0))
    with Server(factory, opts, keys=keys) as server:
        _write_atomic(endpoint_file, " ".join(server.endpoints))
        server.wait()
        server.raise_if_failed()


def run_pausing_trainer(
    addresses, out_file: str, pause_after: int, resume_file: str, credits: int = 4, connect_timeout: float = 15.0
) -> None:
    """Like run_trainer, but after `pause_after` batches the training loop stops (holding that
    batch, its network thread still running) until `resume_file` exists, writes RESUMED and goes
    on. Ends with "END" (or "LOST <reason>" on ServerLostError), then "STATS <fenced> <stale>"."""
    import logging

    from crossfeed.errors import ServerLostError
    from crossfeed.net import connect

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    hb = dict(FAST_HB, connect_timeout=connect_timeout)
    with open(out_file, "a", buffering=1) as out, connect(addresses, credits=credits, with_meta=True, **hb) as c:
        try:
            for n, (meta, _batch) in enumerate(c, 1):
                out.write(json.dumps(meta.sample_ids.tolist()) + "\n")
                out.flush()
                if n == pause_after:
                    out.write("PAUSED\n")
                    while not os.path.exists(resume_file):
                        time.sleep(0.02)
                    out.write("RESUMED\n")
            out.write("END\n")
        except ServerLostError as e:
            out.write(f"LOST {e.reason}\n")
        finally:
            out.write(f"STATS {c.fenced} {c.stale_dropped}\n")


class TcpProxy:
    """A loopback TCP forwarder to `port` that the test can break: `swallow` drops what the
    server sends while set; `reset()` closes every connection through it (clients reconnect)."""

    def __init__(self, port: int):
        self._upstream = port
        self._listen = socket.create_server(("127.0.0.1", 0))
        self._listen.setblocking(False)
        self.port = self._listen.getsockname()[1]
        self.swallow = False
        self._pairs: dict = {}  # socket -> its other end
        self._clients: set = set()
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.05):
                sock = key.fileobj
                with self._lock:
                    if sock is self._listen:
                        client, _ = self._listen.accept()
                        server = socket.create_connection(("127.0.0.1", self._upstream))
                        for s in (client, server):
                            s.setblocking(True)
                            self._sel.register(s, selectors.EVENT_READ)
                        self._pairs[client], self._pairs[server] = server, client
                        self._clients.add(client)
                        continue
                    other = self._pairs.get(sock)
                    if other is None:
                        continue
                    try:
                        data = sock.recv(1 << 16)
                    except OSError:
                        data = b""
                    if not data:
                        self._drop(sock)
                        continue
                    if self.swallow and sock not in self._clients:
                        continue  # from the server: lost on the way
                    try:
                        other.sendall(data)
                    except OSError:
                        self._drop(sock)

    def _drop(self, sock) -> None:
        other = self._pairs.pop(sock, None)
        for s in (sock, other):
            if s is None:
                continue
            self._pairs.pop(s, None)
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            self._clients.discard(s)
            s.close()

    def reset(self) -> None:
        with self._lock:
            for sock in list(self._pairs):
                self._drop(sock)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.reset()
        self._listen.close()
