"""Child-process entry points and helpers of the dispatcher tests (`tests/test_net_dispatch.py`)."""

from __future__ import annotations

import collections
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


def hang(sample: dict) -> dict:
    """A transform that never returns (`--transform dispatch_helpers:hang`): a server whose
    batches are never built, while its lease thread beats on (the test kills it)."""
    time.sleep(600)
    return sample


def slow(sample: dict) -> dict:
    """A slow transform (`--transform dispatch_helpers:slow`): 10 ms per sample, asleep (the GIL
    released: it takes no CPU from the other processes), the sample unchanged."""
    time.sleep(0.01)
    return sample


def sleep_2ms(sample: dict) -> dict:
    """2 ms a sample, asleep (`--transform dispatch_helpers:sleep_2ms`): a server of a known rate."""
    time.sleep(0.002)
    return sample


def sleep_3ms(sample: dict) -> dict:
    """3 ms a sample, asleep: a server 2/3 as fast as `sleep_2ms`'s."""
    time.sleep(0.003)
    return sample


def serve_trainer(addresses: str, out_file: str) -> None:
    """`crossfeed.connect([...])` at its defaults over the space-separated `addresses` (plain
    servers, no dispatcher): one JSON line per batch, [sample ids, server id, epoch], then END."""
    import logging

    from crossfeed import connect

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    with (
        open(out_file, "a", buffering=1) as out,
        connect(addresses.split(), with_meta=True, heartbeat_interval=0.1, heartbeat_timeout=1.5) as c,
    ):
        for meta, _batch in c:
            out.write(json.dumps([meta.sample_ids.tolist(), meta.server_id, meta.epoch]) + "\n")
            out.flush()
        out.write("END\n")


def start_fleet_dispatcher(tmp_path, dataset, name, *extra):
    """`crossfeed dispatch` at its lease defaults (lease size, window, lease timeout), fast
    heartbeats, batch 4; (process, address)."""
    from net_helpers import wait_until

    ep = tmp_path / f"{name}.ep"
    argv = ["dispatch", dataset, "tcp://127.0.0.1:0", "--batch-size", "4", "--journal", str(tmp_path / f"{name}.j")]
    argv += [*HB, "--linger", "1", "--endpoint-file", str(ep), *extra]
    proc = spawn("cli", *argv, log=tmp_path / f"{name}.log")
    return proc, wait_until(lambda: ep.exists() and ep.read_text(), 30, "the dispatcher's endpoint", [proc])


def trainer(
    dispatcher: str, out_file: str, pace: float | str = 0.0, keys: str = "", fields: bool = False, hang_after: int = 0
) -> None:
    """One JSON line of sample ids per batch (flushed before the next is asked for), then END;
    `pace`: seconds to sleep after each batch, or a file holding them (read after each batch: the
    test slows the trainers down while something starts, whatever the machine's load);
    `fields`: each line also has the batch's label, pid and pooled columns (see `tag_sample`);
    `hang_after` N: the loop hangs after its N-th batch (its client thread beats on; the test
    kills it)."""
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
            if hang_after and c.batches >= hang_after:
                time.sleep(600)
            wait = float(Path(pace).read_text()) if isinstance(pace, str) else pace
            if wait:
                time.sleep(wait)
        out.write(f"END {c.refused} {c.duplicates}\n")


def packed_trainer(dispatcher: str, out_file: str, pace: str) -> None:
    """`trainer` for packed batches (which carry no sample ids): one JSON line per batch, its
    epoch, seq, server id and columns; `pace` a file holding the seconds to sleep after each."""
    import logging

    from crossfeed import connect

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    with (
        open(out_file, "a", buffering=1) as out,
        connect(
            dispatcher=dispatcher,
            credits=2,
            with_meta=True,
            heartbeat_interval=0.1,
            heartbeat_timeout=1.5,
            connect_timeout=10.0,
        ) as c,
    ):
        for meta, batch in c:
            cols = {k: batch[k].tolist() for k in ("tokens", "segment_ids", "positions")}
            out.write(json.dumps([meta.epoch, meta.seq, meta.server_id, cols]) + "\n")
            out.flush()
            wait = float(Path(pace).read_text())
            if wait:
                time.sleep(wait)
        out.write(f"END {c.refused} {c.duplicates}\n")


def read_packed(path: Path) -> list[tuple[int, int, str, dict]]:
    """The lines of a `packed_trainer`: (epoch, seq, server id, columns)."""
    if not path.exists():
        return []
    return [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.startswith("[")]


def timed_trainer(dispatcher: str, id_file: str, pace: float) -> None:
    """A trainer that sleeps `pace` s after each batch (its own step) and runs until killed;
    after each batch `id_file` holds its id as the dispatcher lists it (`trainer_id`)."""
    import logging

    from crossfeed import connect

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    with connect(
        dispatcher=dispatcher, credits=2, heartbeat_interval=0.1, heartbeat_timeout=1.5, connect_timeout=10.0
    ) as c:
        for _batch in c:
            if not Path(id_file).exists() or Path(id_file).read_text() != c.trainer_id:
                tmp = Path(id_file + ".tmp")
                tmp.write_text(c.trainer_id)
                tmp.replace(id_file)
            if pace:
                time.sleep(pace)


def read_batches(path: Path) -> list[tuple[list[int], str]]:
    if not path.exists():
        return []
    return [tuple(json.loads(line)[:2]) for line in path.read_text().splitlines() if line.startswith("[")]


def read_fields(path: Path) -> list[tuple[list[int], str, dict]]:
    """The lines of a `trainer(..., fields=True)`: (sample ids, server id, columns)."""
    return [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.startswith("[")]


def start_dispatcher(tmp_path, dataset, address, *extra, name="d", batch=4):
    """`crossfeed dispatch` in a child (fast heartbeats, leases of 2, a window of 4); (process, address)."""
    from net_helpers import wait_until

    ep = tmp_path / f"{name}.ep"
    ep.unlink(missing_ok=True)
    argv = ["dispatch", dataset, address, "--batch-size", str(batch), "--journal", str(tmp_path / "journal")]
    argv += [*HB, "--lease-size", "2", "--window", "4", "--linger", "1", "--endpoint-file", str(ep), *extra]
    proc = spawn("cli", *argv, log=tmp_path / f"{name}.log")
    return proc, wait_until(lambda: ep.exists() and ep.read_text(), 30, "the dispatcher's endpoint", [proc])


def start_server(tmp_path, dataset, dispatcher, name, *extra):
    argv = ["serve", dataset, "tcp://127.0.0.1:0", "--dispatcher", dispatcher, *HB, *extra]
    return spawn("cli", *argv, log=tmp_path / f"{name}.log")


def curve_keys(tmp_path):
    """CURVE everywhere: one key directory serves the dispatcher, the servers and the trainers."""
    from crossfeed.net import keygen

    keys = tmp_path / "keys"
    keygen(keys, "server")
    keygen(keys, "client")
    return ["--auth-keys", str(keys)], ["--auth-keys", str(keys), "--dispatcher-keys", str(keys)], str(keys)


def used(outs) -> collections.Counter:
    return collections.Counter(i for out in outs for ids, _server in read_batches(out) for i in ids)


def served_by(outs, proc) -> int:
    """How many batches the trainers used from the server process `proc`."""
    return sum(server.endswith(f":{proc.pid}") for out in outs for _ids, server in read_batches(out))


def fd_trainer(dispatcher: str, out_file: str, pace: str, fd_file: str, connect_timeout: float) -> None:
    """`trainer` (pace from a file) that also appends its open file descriptors (/proc/self/fd)
    to `fd_file`, one count a line, every 0.1 s until it ends."""
    import logging
    import threading

    from crossfeed import connect

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    done = threading.Event()

    def count() -> None:
        with open(fd_file, "a", buffering=1) as f:
            while not done.wait(0.1):
                f.write(f"{len(os.listdir('/proc/self/fd'))}\n")

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    with (
        open(out_file, "a", buffering=1) as out,
        connect(
            dispatcher=dispatcher,
            credits=2,
            with_meta=True,
            heartbeat_interval=0.1,
            heartbeat_timeout=1.5,
            connect_timeout=connect_timeout,
        ) as c,
    ):
        for meta, _batch in c:
            out.write(json.dumps([meta.sample_ids.tolist(), meta.server_id]) + "\n")
            out.flush()
            time.sleep(float(Path(pace).read_text()))
        out.write(f"END {c.refused} {c.duplicates}\n")
    done.set()
    counter.join()


def fds_of(fd_file: Path) -> list[int]:
    """The counts an `fd_trainer` wrote (a last line cut short is left out)."""
    text = fd_file.read_text() if fd_file.exists() else ""
    return [int(x) for x in text.split("\n")[:-1] if x]
