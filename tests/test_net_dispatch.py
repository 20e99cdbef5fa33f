"""`crossfeed dispatch` with real processes: servers killed, added, a dispatcher restarted,
hostile messages; every sample is used exactly once across the trainers."""

from __future__ import annotations

import collections
import os
import signal

import pytest
import zmq
from dispatch_helpers import (
    curve_keys,
    read_batches,
    read_fields,
    served_by,
    spawn,
    start_dispatcher,
    start_server,
    used,
)
from net_helpers import stop, wait_until

from crossfeed.net.lease import messages as W

pytestmark = pytest.mark.timeout(120)

N, BATCH = 480, 4  # 120 batches


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds"
    from dispatch_helpers import write_dataset

    write_dataset(str(path), N)
    return str(path)


def _set(path, text: str) -> None:
    """Replace a file's text at once (a reader never sees it empty)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.mark.slow
@pytest.mark.parametrize("curve", [False, True])
def test_a_killed_a_stopped_and_a_new_server_mid_epoch_every_sample_once(tmp_path, dataset, curve):
    keys_extra, server_extra, trainer_keys = curve_keys(tmp_path) if curve else ([], [], "")
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0", *keys_extra)
    procs = [d]
    try:
        servers = [start_server(tmp_path, dataset, address, f"s{i}", *server_extra) for i in range(3)]
        procs += servers
        outs = [tmp_path / f"t{i}.out" for i in range(2)]
        pace = tmp_path / "pace"
        _set(pace, "0.05")
        trainers = [
            spawn("trainer", address, str(out), str(pace), trainer_keys, log=tmp_path / f"t{i}.log")
            for i, out in enumerate(outs)
        ]
        procs += trainers
        victim = servers[0]
        wait_until(lambda: served_by(outs, victim), 60, "a batch from the server to kill", procs)
        _set(pace, "0.5")  # slower while the 4th server starts: the epoch must not end before it joins
        os.kill(victim.pid, signal.SIGKILL)  # mid-epoch, holding leases
        fourth = start_server(tmp_path, dataset, address, "s3", *server_extra)
        procs.append(fourth)
        live = [p for p in procs if p is not victim]
        wait_until(lambda: served_by(outs, fourth), 60, "a batch from the 4th server", live)
        _set(pace, "0.05")
        servers[1].send_signal(signal.SIGTERM)  # leaves: hands its leases back
        assert servers[1].wait(30) == 0, (tmp_path / "s1.log").read_text()[-3000:]
        for t in trainers:
            assert t.wait(90) == 0, [(tmp_path / f"t{i}.log").read_text()[-3000:] for i in range(2)]
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    counts = used(outs)
    assert counts == collections.Counter(range(N)), "a sample was lost or used twice"
    log = (tmp_path / "d.log").read_text()
    assert "declared dead" in log  # the killed server's leases were revoked
    assert " left: " in log  # the one stopped with SIGTERM handed its leases back
    assert served_by(outs, fourth) > 0, "the 4th server got no work"
    assert served_by(outs, victim) < N // BATCH


@pytest.mark.slow
@pytest.mark.parametrize("curve", [False, True])
def test_a_restarted_dispatcher_continues_the_epoch_exactly_once(tmp_path, dataset, curve):
    keys_extra, server_extra, trainer_keys = curve_keys(tmp_path) if curve else ([], [], "")
    address = f"ipc://{tmp_path}/dispatch.sock"
    d, _ = start_dispatcher(tmp_path, dataset, address, *keys_extra)
    procs = [d]
    try:
        procs += [start_server(tmp_path, dataset, address, f"s{i}", *server_extra) for i in range(2)]
        outs = [tmp_path / f"t{i}.out" for i in range(2)]
        trainers = [
            spawn("trainer", address, str(out), 0.05, trainer_keys, log=tmp_path / f"t{i}.log")
            for i, out in enumerate(outs)
        ]
        procs += trainers
        wait_until(lambda: sum(used(outs).values()) >= 40, 60, "40 samples used", procs)
        os.kill(d.pid, signal.SIGKILL)
        d.wait(10)
        before = sum(used(outs).values())
        d2, _ = start_dispatcher(tmp_path, dataset, address, *keys_extra, name="d2")
        procs.append(d2)
        for t in trainers:
            assert t.wait(90) == 0, [(tmp_path / f"t{i}.log").read_text()[-3000:] for i in range(2)]
        assert d2.wait(30) == 0, (tmp_path / "d2.log").read_text()[-3000:]
    finally:
        stop(*procs)
    assert before < N
    assert used(outs) == collections.Counter(range(N)), "a sample was lost or used twice"
    assert "continuing from journal" in (tmp_path / "d2.log").read_text()


@pytest.mark.slow
def test_hostile_messages_are_dropped_and_the_epoch_completes(tmp_path, dataset):
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0")
    procs = [d]
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(address)
        env = W.pack(W.Kind.BEAT, role=2, sender=7)[0]
        hostile = [
            [b""],
            [b"x" * 10],
            [b"XXXX" + env[4:]],  # bad magic
            [env[:5] + b"\x63" + env[6:]],  # unknown kind
            [env, b"extra"],  # BEAT with a payload
            W.pack(W.Kind.BEAT, role=9, sender=7),  # unknown role
            W.pack(W.Kind.BEAT, role=2, sender=0),  # sender 0
            [W.pack(W.Kind.CLAIM, sender=7)[0], b"123"],  # not whole pairs
            W.pack(W.Kind.CLAIM, sender=7, payload=[[-1, -1], [1 << 62, 5], [3, 0]]),
            W.pack(W.Kind.DONE, sender=7, payload=[-5, 10**15]),
            W.pack(W.Kind.HELLO, sender=8, payload="not-an-endpoint"),
            [W.pack(W.Kind.HELLO, sender=8)[0], b"\xff\xfe"],  # not UTF-8
            W.pack(W.Kind.WELCOME, sender=8, payload="{}"),  # a dispatcher's kind
            [env, b"a", b"b", b"c"],
        ]
        for frames in hostile:
            sock.send_multipart(frames)
        procs.append(start_server(tmp_path, dataset, address, "s0"))
        out = tmp_path / "t0.out"
        trainer = spawn("trainer", address, str(out), 0.0, log=tmp_path / "t0.log")
        procs.append(trainer)
        assert trainer.wait(90) == 0, (tmp_path / "t0.log").read_text()[-3000:]
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        ctx.destroy(linger=0)
        stop(*procs)
    assert used([out]) == collections.Counter(range(N))
    assert "dropped a malformed message" in (tmp_path / "d.log").read_text()


@pytest.mark.slow
def test_a_trainer_claims_what_it_received_together_and_reports_done_in_groups(tmp_path, dataset):
    """A trainer that pauses after its first batch finds several batches received on its return:
    it claims them in one CLAIM and, using the grants without waiting, reports them DONE together;
    the epoch still holds every sample exactly once."""
    import re
    import time

    from crossfeed import connect

    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0")
    procs = [d]
    try:
        procs.append(start_server(tmp_path, dataset, address, "s0"))
        ids: list[int] = []
        with connect(dispatcher=address, credits=8, with_meta=True, heartbeat_interval=0.1, heartbeat_timeout=1.5) as c:
            for meta, _batch in c:
                ids += meta.sample_ids.tolist()
                if c.batches == 1:
                    time.sleep(1.0)  # the server's window of batches arrives meanwhile
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    assert collections.Counter(ids) == collections.Counter(range(N))
    log = (tmp_path / "d.log").read_text()
    got = re.search(r"(\d+) batches granted in (\d+) CLAIM messages, (\d+) DONE messages", log)
    assert got, log[-3000:]
    granted, claims, dones = map(int, got.groups())
    assert granted == N // BATCH
    assert claims < granted and dones < granted, got.group(0)


@pytest.mark.slow
def test_lockstep_ranks_get_equal_batch_counts_each_sample_once(tmp_path, dataset):
    """--world-size 2: a fast and a slow trainer each use the Loader's per-rank count (35 batches
    of 7 of the 240 samples a rank gets, the last one short), every sample exactly once."""
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0", "--world-size", "2", batch=7)
    procs = [d]
    try:
        procs += [start_server(tmp_path, dataset, address, f"s{i}") for i in range(2)]
        outs = [tmp_path / f"t{i}.out" for i in range(2)]
        trainers = [
            spawn("trainer", address, str(out), pace, log=tmp_path / f"t{i}.log")
            for i, (out, pace) in enumerate(zip(outs, [0.0, 0.03]))
        ]
        procs += trainers
        for t in trainers:
            assert t.wait(90) == 0, [(tmp_path / f"t{i}.log").read_text()[-3000:] for i in range(2)]
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    assert [len(read_batches(out)) for out in outs] == [35, 35]
    assert used(outs) == collections.Counter(range(N))


@pytest.mark.slow
def test_a_stalled_server_that_wakes_up_is_fenced(tmp_path, dataset):
    """SIGSTOP a server past the heartbeat timeout (its leases go to the other), SIGCONT it: what
    it still sends under its revoked leases is refused at the trainers, never used twice."""
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0")
    procs = [d]
    try:
        servers = [start_server(tmp_path, dataset, address, f"s{i}") for i in range(2)]
        procs += servers
        outs = [tmp_path / f"t{i}.out" for i in range(2)]
        trainers = [spawn("trainer", address, str(out), 0.05, log=tmp_path / f"t{i}.log") for i, out in enumerate(outs)]
        procs += trainers
        stalled = servers[0]
        wait_until(lambda: served_by(outs, stalled), 60, "a batch from the server to stall", procs)
        stalled.send_signal(signal.SIGSTOP)
        wait_until(
            lambda: "declared dead" in (tmp_path / "d.log").read_text(), 30, "the stalled server's leases revoked"
        )
        stalled.send_signal(signal.SIGCONT)
        for t in trainers:
            assert t.wait(90) == 0, [(tmp_path / f"t{i}.log").read_text()[-3000:] for i in range(2)]
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        stop(*procs)
    assert used(outs) == collections.Counter(range(N)), "a sample was lost or used twice"
    assert "does not know us" in (tmp_path / "s0.log").read_text()  # it was told to rejoin


def labels_by_index(dataset: str) -> dict[int, int]:
    """Sample index -> label, read here without a transform."""
    import crossfeed

    with crossfeed.Loader(dataset, batch_size=64, shuffle="none", return_index=True) as loader:
        return {int(i): int(v) for b in loader for i, v in zip(b["__index__"], b["label"])}


@pytest.mark.slow
@pytest.mark.parametrize("executor", [["--procs", "2"], ["--threads", "2"]], ids=["procs", "threads"])
def test_leased_batches_are_built_by_the_servers_executor(tmp_path, dataset, executor):
    """`serve --dispatcher --procs 2 / --threads 2 --transform mod:fn`: the leased batches are built
    in the Loader's worker processes (other pids than the server's) or pool threads, the
    transform applied, every sample exactly once."""
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0")
    procs = [d]
    try:
        extra = [*executor, "--transform", "dispatch_helpers:tag_sample"]
        servers = [start_server(tmp_path, dataset, address, f"s{i}", *extra) for i in range(2)]
        procs += servers
        out = tmp_path / "t0.out"
        trainer = spawn("trainer", address, str(out), 0.0, "", True, log=tmp_path / "t0.log")
        procs.append(trainer)
        assert trainer.wait(90) == 0, (tmp_path / "t0.log").read_text()[-3000:]
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    lines = read_fields(out)
    assert collections.Counter(i for ids, _s, _f in lines for i in ids) == collections.Counter(range(N))
    label = labels_by_index(dataset)
    for ids, server, fields in lines:
        assert fields["label"] == [label[i] + 1000 for i in ids], "the transform was not applied"
        server_pid = int(server.rsplit(":", 1)[1])
        assert server_pid in {s.pid for s in servers}
        if executor[0] == "--procs":
            assert server_pid not in fields["pid"], "a batch was built in the server, not its worker processes"
        else:
            assert fields["pid"] == [server_pid] * len(ids) and fields["pooled"] == [1] * len(ids)
    if executor[0] == "--procs":
        pids = {p for _ids, _s, fields in lines for p in fields["pid"]}
        assert len(pids) >= 2, "one worker process built every batch"


@pytest.mark.slow
def test_a_transform_that_raises_in_a_worker_process_stops_the_server_with_its_error(tmp_path, dataset):
    """`--procs 2` and a transform that raises at one sample: the server exits non-zero naming the
    transform's error (crossed from the worker process), having handed its leases back."""
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0")
    procs = [d]
    try:
        server = start_server(
            tmp_path, dataset, address, "s0", "--procs", "2", "--transform", "procs_helpers:fail_at_label"
        )
        procs.append(server)
        procs.append(spawn("trainer", address, str(tmp_path / "t0.out"), log=tmp_path / "t0.log"))
        assert server.wait(60) != 0
    finally:
        stop(*procs)
    log = (tmp_path / "s0.log").read_text()
    assert "transform refuses label 13" in log and "worker process" in log and "of epoch 0, lease" in log, log[-3000:]


def _beat(b: int, role: int = 2, sender: int = 7) -> bytes:
    """A BEAT envelope with slot b (wait_permille) set to `b`, whatever its range."""
    import struct

    return struct.pack("<4sBBHqqqQQ", W.MAGIC, W.VERSION, int(W.Kind.BEAT), 0, 1, b, role, sender, 0)


def test_a_trainers_wait_share_reaches_the_status_and_a_beat_out_of_range_is_dropped_and_counted(tmp_path, dataset):
    import time

    from crossfeed.net import status as S

    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(address)

        def status(wait: int = W.encode_wait(0.5)):
            sock.send(_beat(wait))  # keeps trainer 7 alive (and reports `wait`)
            time.sleep(0.1)  # at most RATE status answers a second
            st = S.DispatcherStatus.parse(S.query(address))
            return st, {t.id: t for t in st.trainers}.get("0000000000000007")

        st, t7 = wait_until(lambda: (got := status()) and got[1] and got[1].wait == 0.5 and got, 30, "trainer 7's wait")
        assert t7.wait_age is not None and st.counters["dropped_messages"] == 0
        for frames in ([_beat(W.WAIT_END + 1)], [_beat(-1)], [_beat(5, role=1, sender=8)]):  # 8: a server
            sock.send_multipart(frames)
        st, t7 = wait_until(
            lambda: (got := status(0)) and got[0].counters["dropped_messages"] >= 3 and got, 30, "the bad BEATs dropped"
        )
        assert st.counters["dropped_messages"] == 3, st.counters
        assert t7.wait == 0.5, t7  # not reported (0): its last report stands, and the bad ones changed nothing
        assert st.trainers_total == 1 and st.servers_total == 0
    finally:
        ctx.destroy(linger=0)
        stop(d)
    assert "wait_permille is 1002, outside 0..1001" in (tmp_path / "d.log").read_text()
