"""A fleet of mixed-speed servers under `crossfeed dispatch` at its defaults (real processes):
adding a server adds its rate, adding a slow server does not slow the trainer down, a stalled
one's work is carried by the others long before the lease timeout, and every sample is used once
per epoch throughout; and under plain `serve` with `connect([...])`, a slow server does not hold
the fast one back."""

from __future__ import annotations

import collections
import json
import time

import pytest
from dispatch_helpers import HB, read_batches, served_by, spawn, start_fleet_dispatcher, start_server
from net_helpers import stop, wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # real dispatchers, servers and trainers, timed runs

N, BATCH = 480, 4  # 120 batches an epoch
PER_EPOCH = N // BATCH
RUN = 8.0  # seconds each configuration is timed (from its first batch)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds"
    from dispatch_helpers import write_dataset

    write_dataset(str(path), N)
    return str(path)


def _epochs_once(out) -> int:
    """Each whole epoch the trainer used (one trainer: epoch e is its lines e*120..e*120+119,
    as the next epoch is leased only once every batch of this one is used): every sample once."""
    lines = read_batches(out)
    whole = len(lines) // PER_EPOCH
    for e in range(whole):
        got = collections.Counter(i for ids, _ in lines[e * PER_EPOCH : (e + 1) * PER_EPOCH] for i in ids)
        assert got == collections.Counter(range(N)), f"epoch {e}: a sample was lost or used twice"
    return whole


def _timed(tmp_path, dataset, name, server_transforms):
    """Batches one unpaced trainer used in RUN s from its first one, with servers built by
    `server_transforms` (None: no transform); (batches, their lines, the server processes)."""
    d, address = start_fleet_dispatcher(tmp_path, dataset, name, "--epochs", "1000")
    procs = [d]
    try:
        servers = []
        for i, fn in enumerate(server_transforms):
            extra = ["--transform", f"dispatch_helpers:{fn}"] if fn else []
            servers.append(start_server(tmp_path, dataset, address, f"{name}-s{i}", *extra))
        procs += servers
        wait_until(
            lambda: all(
                "joined the dispatcher" in (tmp_path / f"{name}-s{i}.log").read_text() for i in range(len(servers))
            ),
            60,
            "the servers joined",
            procs,
        )
        out = tmp_path / f"{name}.out"
        procs.append(spawn("trainer", address, str(out), 0.0, log=tmp_path / f"{name}-t.log"))
        wait_until(lambda: read_batches(out), 60, "a first batch", procs)
        start = len(read_batches(out))
        time.sleep(RUN)
        got = len(read_batches(out)) - start
        stop(*procs[::-1])
        return got, out, servers
    finally:
        stop(*procs)


def test_a_slow_server_added_does_not_slow_the_trainer_and_every_sample_is_used_once(tmp_path, dataset):
    alone, _, _ = _timed(tmp_path, dataset, "alone", [None])
    pair, out, (fast, slow) = _timed(tmp_path, dataset, "pair", [None, "slow"])
    epochs = _epochs_once(out)
    print(f"fast alone: {alone} batches in {RUN}s; fast + slow: {pair} ({pair / alone:.2f}x)")
    assert epochs >= 1, (alone, pair)
    # the slow server (40 ms a batch) adds little; before rates it took the window at each epoch's
    # start and the trainer waited for its tail: 3 to 10 times fewer batches than the fast one alone
    assert pair >= 0.7 * alone, f"fast alone: {alone} batches in {RUN}s; fast + slow: {pair}"
    assert served_by([out], fast) > served_by([out], slow)
    log = (tmp_path / "pair.log").read_text()
    assert "stalled" not in log


def test_a_stalled_server_s_work_is_carried_long_before_the_lease_timeout(tmp_path, dataset):
    """A server whose transform never returns (it beats on) holds leases at each epoch's start:
    the other takes them over within seconds, far inside the default lease timeout (120 s)."""
    d, address = start_fleet_dispatcher(tmp_path, dataset, "d", "--epochs", "3")
    procs = [d]
    try:
        stuck = start_server(tmp_path, dataset, address, "stuck", "--transform", "dispatch_helpers:hang")
        procs.append(stuck)
        wait_until(
            lambda: "joined the dispatcher" in (tmp_path / "stuck.log").read_text(), 60, "the stuck server", procs
        )
        good = start_server(tmp_path, dataset, address, "good")
        procs.append(good)
        out = tmp_path / "t.out"
        t = spawn("trainer", address, str(out), 0.0, log=tmp_path / "t.log")
        procs.append(t)
        began = time.monotonic()
        assert t.wait(100) == 0, (tmp_path / "t.log").read_text()[-3000:]
        took = time.monotonic() - began
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    assert _epochs_once(out) == 3
    assert served_by([out], good) == 3 * PER_EPOCH
    log = (tmp_path / "d.log").read_text()
    assert "stalled" not in log, "the stuck server's work waited for the lease timeout"
    assert took < 100


def test_two_servers_of_comparable_speeds_deliver_more_than_the_faster_alone(tmp_path, dataset):
    """Servers sleeping 2 and 3 ms a sample (the GIL released): the pair gives about r1 + r2
    (1.6x the faster alone; `benchmarks/bench_fleet.py` measures 0.92-1.03 of r1 + r2); asserted
    loosely: more than the faster alone, both servers used, every sample once."""
    alone, _, _ = _timed(tmp_path, dataset, "a", ["sleep_2ms"])
    pair, out, (a, b) = _timed(tmp_path, dataset, "ab", ["sleep_2ms", "sleep_3ms"])
    print(f"2 ms alone: {alone} batches in {RUN}s; with 3 ms: {pair} ({pair / alone:.2f}x)")
    assert _epochs_once(out) >= 1
    assert pair > alone, f"2 ms alone: {alone} batches in {RUN}s; 2 ms + 3 ms: {pair}"
    assert served_by([out], a) > 0 and served_by([out], b) > 0


def test_under_serve_a_slow_server_does_not_hold_the_fast_one_back(tmp_path, dataset):
    """Plain `serve` (static shares: --rank/--world-size 2, 2 epochs) and `connect([fast, slow])`:
    the client gives each server its own credit, so the fast server's whole stream (both epochs of
    its share) arrives while the slow one (10 ms a sample) is still in its first epoch; each epoch's
    samples are the two shares together, every one once."""
    procs, eps = [], []
    try:
        for i, extra in enumerate([[], ["--transform", "dispatch_helpers:slow"]]):
            ep = tmp_path / f"s{i}.ep"
            argv = ["serve", dataset, "tcp://127.0.0.1:0", "--batch-size", str(BATCH), *HB, "--epochs", "2"]
            argv += ["--rank", str(i), "--world-size", "2", "--endpoint-file", str(ep), *extra]
            procs.append(spawn("cli", *argv, log=tmp_path / f"s{i}.log"))
            eps.append(ep)
        fast, slow = procs
        addresses = [wait_until(lambda e=e: e.exists() and e.read_text().strip(), 60, "a server", procs) for e in eps]
        out = tmp_path / "t.out"
        t = spawn("serve_trainer", " ".join(addresses), str(out), log=tmp_path / "t.log")
        procs.append(t)
        assert t.wait(120) == 0, (tmp_path / "t.log").read_text()[-3000:]
    finally:
        stop(*procs)
    text = out.read_text().splitlines()
    assert text[-1] == "END"
    lines = [json.loads(x) for x in text[:-1]]
    for e in (0, 1):
        got = collections.Counter(i for ids, _, epoch in lines if epoch == e for i in ids)
        assert got == collections.Counter(range(N)), f"epoch {e}: a sample was lost or used twice"
    of_fast = [k for k, (_, server, _) in enumerate(lines) if server.endswith(f":{fast.pid}")]
    slow_first = [k for k, (_, server, epoch) in enumerate(lines) if server.endswith(f":{slow.pid}") and epoch == 0]
    assert len(of_fast) == 2 * PER_EPOCH // 2 and len(slow_first) == PER_EPOCH // 2
    assert of_fast[-1] < slow_first[-1], "the fast server's stream waited for the slow one's"
