"""`crossfeed dispatch` against peers that beat but do not work, and against forged ones (issue 22,
items 10-12), with real dispatcher, server and trainer processes and raw attacker sockets:
a server whose batches are never built and a trainer whose loop hangs lose their work to the
others at their progress deadline; claims cannot be guessed (each needs the token its server
sent only with the batch); oversized or numerous server registrations cannot silence SERVERS."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import zmq
from dispatch_helpers import read_batches, served_by, spawn, start_dispatcher, start_server, used
from net_helpers import stop, wait_until

from crossfeed.net.lease import messages as W
from crossfeed.net.lease.dispatcher import DispatcherOptions, LeaseDispatcher
from crossfeed.net.protocol import Heartbeat

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # slow: lease deadlines with several processes

N, BATCH = 240, 4  # 60 batches
DEADLINES = ["--lease-timeout", "3", "--claim-timeout", "3"]
SERVER, TRAINER = 1, 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds"
    from dispatch_helpers import write_dataset

    write_dataset(str(path), N)
    return str(path)


def logs(tmp_path, *names) -> list[str]:
    return [(tmp_path / f"{name}.log").read_text()[-3000:] for name in names]


def test_a_server_whose_batches_are_never_built_loses_its_leases_at_the_deadline(tmp_path, dataset):
    """Its transform hangs while its lease thread beats: its leased batches go to the healthy
    server (taken over within seconds, or at the latest past --lease-timeout, where it is declared
    stalled), and the epoch completes, each sample once."""
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0", *DEADLINES)
    procs = [d]
    try:
        stuck = start_server(tmp_path, dataset, address, "stuck", "--transform", "dispatch_helpers:hang")
        procs.append(stuck)
        wait_until(lambda: "joined at" in (tmp_path / "d.log").read_text(), 30, "the stuck server to join", procs)
        procs.append(start_server(tmp_path, dataset, address, "s0"))
        out = tmp_path / "t0.out"
        trainer = spawn("trainer", address, str(out), log=tmp_path / "t0.log")
        procs.append(trainer)
        assert trainer.wait(90) == 0, logs(tmp_path, "t0", "d")
        assert d.wait(30) == 0, logs(tmp_path, "d")
    finally:
        stop(*procs)
    assert used([out]) == collections.Counter(range(N)), "a sample was lost or used twice"
    assert served_by([out], stuck) == 0
    log = (tmp_path / "d.log").read_text()
    # the healthy server takes its leased batches over as soon as it has built the others (a
    # server that delivered nothing for 1 s), or, should it still hold some then, the deadline
    assert "takes over" in log or "leased batches for more than 3s: stalled" in log, log[-3000:]


def test_a_trainer_whose_loop_hangs_loses_its_claims_at_the_deadline(tmp_path, dataset):
    """Its client thread beats on, its loop hangs on its 3rd batch: past --claim-timeout it is
    declared stalled, what it claimed and did not use goes to the other trainer (and so do the
    batches waiting unclaimed in its receiver, their leases overtaken); the epoch completes. Only
    the batch the loop hangs on (never reported done) is used by both."""
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0", *DEADLINES)
    procs = [d]
    try:
        procs.append(start_server(tmp_path, dataset, address, "s0"))
        hung_out, out = tmp_path / "hung.out", tmp_path / "t0.out"
        hung = spawn("trainer", address, str(hung_out), 0.0, "", False, 3, log=tmp_path / "hung.log")
        procs.append(hung)
        wait_until(lambda: len(read_batches(hung_out)) == 3, 60, "the hung trainer's 3 batches", procs)
        trainer = spawn("trainer", address, str(out), log=tmp_path / "t0.log")
        procs.append(trainer)
        assert trainer.wait(90) == 0, logs(tmp_path, "t0", "d")
        assert d.wait(30) == 0, logs(tmp_path, "d")
        assert hung.poll() is None  # still hanging
    finally:
        stop(*procs)
    hung_batches = read_batches(hung_out)
    assert len(hung_batches) == 3
    held = collections.Counter(hung_batches[-1][0])
    assert used([hung_out, out]) == collections.Counter(range(N)) + held
    assert "reported none done for more than 3s: stalled" in (tmp_path / "d.log").read_text()


class RawPeer:
    """A DEALER that speaks the dispatcher's protocol by hand (an attacker's socket)."""

    def __init__(self, ctx: zmq.Context, address: str, sender: int):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(address)
        self.sender = sender

    def send(self, kind: W.Kind, payload=None, **slots) -> None:
        self.sock.send_multipart(W.pack(kind, sender=self.sender, payload=payload, **slots))

    def drain(self) -> list[W.Message]:
        out = []
        while self.sock.poll(0):
            out.append(W.unpack(self.sock.recv_multipart(), W.TO_TRAINER | W.TO_SERVER))
        return out


def test_guessed_claims_and_a_done_without_data_are_refused(tmp_path, dataset):
    """A peer that never connects to a server CLAIMs every batch under lease ids 1..64 (what
    counted ids would be) and reports every batch DONE: nothing is granted or confirmed, and
    the real trainer gets the whole epoch."""
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0")
    procs = [d]
    ctx = zmq.Context()
    granted = confirmed = answered = 0
    try:
        attacker = RawPeer(ctx, address, sender=0xBAD)
        procs.append(start_server(tmp_path, dataset, address, "s0"))
        out = tmp_path / "t0.out"
        trainer = spawn("trainer", address, str(out), 0.02, log=tmp_path / "t0.log")
        procs.append(trainer)
        guesses = [(seq, lease) for seq in range(N // BATCH) for lease in range(1, 65)]
        deadline = time.monotonic() + 90
        while trainer.poll() is None and time.monotonic() < deadline:
            attacker.send(W.Kind.BEAT, role=TRAINER, sent_ms=1)
            for i in range(0, len(guesses), W.MAX_ITEMS):
                attacker.send(W.Kind.CLAIM, role=TRAINER, payload=guesses[i : i + W.MAX_ITEMS])
            attacker.send(W.Kind.DONE, role=TRAINER, payload=list(range(N // BATCH)))
            time.sleep(0.1)
            for msg in attacker.drain():
                if msg.kind is W.Kind.GRANTS:
                    answered += len(msg.payload)
                    granted += int(msg.payload[:, 2].sum())
                elif msg.kind is W.Kind.DONE_OK and not msg.finished:  # after the end, all is done
                    confirmed += len(msg.payload)
        assert trainer.wait(30) == 0, logs(tmp_path, "t0", "d")
        assert d.wait(30) == 0, logs(tmp_path, "d")
    finally:
        ctx.destroy(linger=0)
        stop(*procs)
    assert answered > 0, "the dispatcher never answered the attacker's claims"
    assert (granted, confirmed) == (0, 0)
    assert used([out]) == collections.Counter(range(N))


def fake_server(ctx, address: str, sender: int, endpoints: int, length: int) -> RawPeer:
    """A raw DEALER that registers `endpoints` tcp endpoints of `length` bytes (and serves nothing)."""
    peer = RawPeer(ctx, address, sender)
    host = f"{sender:x}".ljust(length - len("tcp://:12345"), "h")  # each fake's own
    peer.send(W.Kind.HELLO, payload=" ".join(f"tcp://{host}:{10000 + i}" for i in range(endpoints)))
    return peer


def test_oversized_and_numerous_registrations_do_not_silence_the_servers_reply(tmp_path, dataset):
    """17 fakes announcing 16 endpoints of 256 bytes (70 KiB, past a message's 64 KiB) are
    refused; 40 fakes announcing the most allowed (8 of 256 bytes each: 80 KiB in all) beat on
    and hold leases, and the trainer still learns the real server and gets the whole epoch."""
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0", "--lease-timeout", "3")
    procs = [d]
    ctx = zmq.Context()
    stop_beats = threading.Event()
    try:
        real = start_server(tmp_path, dataset, address, "s0")
        procs.append(real)
        wait_until(lambda: "joined at" in (tmp_path / "d.log").read_text(), 30, "the real server to join", procs)
        oversized = [fake_server(ctx, address, 0x1000 + i, 16, 256) for i in range(17)]
        largest = [fake_server(ctx, address, 0x2000 + i, W.MAX_ENDPOINTS, W.MAX_ENDPOINT) for i in range(40)]

        def beat() -> None:  # every fake beats on (and reads what it is sent), until the end
            while not stop_beats.wait(0.1):
                for peer in oversized + largest:
                    peer.send(W.Kind.BEAT, role=SERVER)
                    peer.drain()

        beats = threading.Thread(target=beat, daemon=True)
        beats.start()
        out = tmp_path / "t0.out"
        trainer = spawn("trainer", address, str(out), log=tmp_path / "t0.log")
        procs.append(trainer)
        assert trainer.wait(90) == 0, logs(tmp_path, "t0", "d")
        assert d.wait(30) == 0, logs(tmp_path, "d")
    finally:
        stop_beats.set()
        stop(*procs)
    beats.join(10)
    ctx.destroy(linger=0)
    assert used([out]) == collections.Counter(range(N))
    assert served_by([out], real) == N // BATCH
    assert "a server announces 1..8 endpoints, got 16" in (tmp_path / "d.log").read_text()


def test_servers_pages_stay_under_a_message_and_reach_every_server(tmp_path):
    """100 servers registering the most allowed: each SERVERS answer fits one message, and a
    trainer's successive BEATs are answered with pages that together name every server."""
    options = DispatcherOptions(f"ipc://{tmp_path}/d.sock", tmp_path / "journal", heartbeat=Heartbeat(0.5, 30.0))
    ctx = zmq.Context()
    try:
        with LeaseDispatcher({"split": "train"}, 10, options) as d:
            fakes = [fake_server(ctx, d.endpoint, 0x3000 + i, W.MAX_ENDPOINTS, W.MAX_ENDPOINT) for i in range(100)]
            wait_until(lambda: len(d.book.servers) == 100, 30, "100 servers registered")
            trainer = RawPeer(ctx, d.endpoint, sender=0x77)
            trainer.sock.setsockopt(zmq.MAXMSGSIZE, W.MAX_MESSAGE)  # as the real client's
            seen: set[str] = set()
            pages = 0
            for _ in range(10):
                trainer.send(W.Kind.BEAT, role=TRAINER, sent_ms=1)
                assert trainer.sock.poll(10_000), "no SERVERS answer"
                msg = W.unpack(trainer.sock.recv_multipart(), W.TO_TRAINER)
                assert msg.kind is W.Kind.SERVERS and 0 < len(msg.payload.encode()) <= W.MAX_TEXT
                seen.update(msg.payload.split(" "))
                pages += 1
                if len(seen) == 100 * W.MAX_ENDPOINTS:
                    break
            assert len(seen) == 100 * W.MAX_ENDPOINTS, f"{len(seen)} endpoints after {pages} pages"
            assert pages > 1
            del fakes
    finally:
        ctx.destroy(linger=0)


def status_of(address: str):
    """The dispatcher's parsed status, or None when it did not answer in time (it answers 20 a
    second at most: a caller polling faster is refused some)."""
    from crossfeed.errors import CrossfeedError
    from crossfeed.net.status import DispatcherStatus, query

    try:
        return DispatcherStatus.parse(query(address, timeout=5))
    except CrossfeedError:
        return None
    finally:
        time.sleep(0.1)


def fake_ipc_server(ctx, address: str, sender: int, root) -> RawPeer:
    """A raw DEALER registering the most allowed: 8 ipc:// endpoints of 256 bytes (serving nothing)."""
    peer = RawPeer(ctx, address, sender)
    stem = f"ipc://{root}/{sender:x}-"
    names = [(stem + f"{i}-").ljust(W.MAX_ENDPOINT, "p") for i in range(W.MAX_ENDPOINTS)]
    peer.send(W.Kind.HELLO, payload=" ".join(names))
    return peer


def test_a_status_answer_longer_than_a_message_lists_fewer_servers_and_the_dispatcher_lives_on(tmp_path, dataset):
    """40 fakes registering 8 ipc:// endpoints of 256 bytes each (80 KiB of addresses, past a
    status answer's 60,000 bytes), then status requests (what `crossfeed top` sends): each answer
    fits, lists fewer servers than it counts, and the dispatcher lives on, so a trainer started
    afterwards gets the whole epoch (the fakes' leases go to the real server at the deadline)."""
    from crossfeed.net.status import MAX_STATUS, DispatcherStatus, query

    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0", "--lease-timeout", "3")
    procs = [d]
    ctx = zmq.Context()
    stop_beats = threading.Event()
    try:
        fakes = [fake_ipc_server(ctx, address, 0x4000 + i, tmp_path) for i in range(40)]

        def beat() -> None:
            while not stop_beats.wait(0.1):
                for peer in fakes:
                    peer.send(W.Kind.BEAT, role=SERVER)
                    peer.drain()

        beats = threading.Thread(target=beat, daemon=True)
        beats.start()
        wait_until(lambda: getattr(status_of(address), "servers_total", 0) == 40, 30, "40 fakes registered", procs)
        for _ in range(3):
            status = DispatcherStatus.parse(query(address, timeout=10))
            assert status.servers_total == 40 and 0 < len(status.servers) < 40, len(status.servers)
            assert sum(len(s.address) for s in status.servers) < MAX_STATUS
        assert d.poll() is None, logs(tmp_path, "d")
        procs.append(start_server(tmp_path, dataset, address, "s0"))
        out = tmp_path / "t0.out"
        trainer = spawn("trainer", address, str(out), log=tmp_path / "t0.log")
        procs.append(trainer)
        assert trainer.wait(90) == 0, logs(tmp_path, "t0", "d")
        assert d.wait(30) == 0, logs(tmp_path, "d")
    finally:
        stop_beats.set()
        stop(*procs)
        ctx.destroy(linger=0)
    assert used([out]) == collections.Counter(range(N))
    assert "exceeds" not in (tmp_path / "d.log").read_text()


def test_a_trainer_closes_dropped_server_links_and_bounds_what_it_holds(tmp_path, dataset):
    """A trainer's open files over a bounded run: 5 real servers started and killed one after
    another (preemptions), then 20 fakes announcing 8 endpoints each where nothing listens.
    Each dropped server's socket is closed (the count after each drop stays where it was), the
    unreachable endpoints are tried again only after a backoff (the count stays bounded), and
    a real replacement server, started last, still delivers the rest of the epoch."""
    from dispatch_helpers import fd_trainer, fds_of  # noqa: F401 (fd_trainer runs in the child)

    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0", "--lease-timeout", "3")
    procs = [d]
    ctx = zmq.Context()
    stop_beats = threading.Event()
    out, pace, fd_file = tmp_path / "t0.out", tmp_path / "pace", tmp_path / "fds"
    pace.write_text("0.3")
    trainer = spawn("fd_trainer", address, str(out), str(pace), str(fd_file), 1.0, log=tmp_path / "t0.log")
    procs.append(trainer)
    after_drop = []
    try:
        for k in range(5):
            s = start_server(tmp_path, dataset, address, f"p{k}")
            procs.append(s)
            wait_until(lambda s=s: served_by([out], s) >= 1, 60, f"a batch from server {k}", procs)
            s.kill()
            s.wait(10)
            procs.remove(s)  # killed on purpose
            drops = lambda k=k: (tmp_path / "t0.log").read_text().count(" dropped (") >= k + 1  # noqa: E731
            wait_until(drops, 30, f"the trainer to drop server {k}", procs)
            seen = len(fds_of(fd_file))
            wait_until(lambda seen=seen: len(fds_of(fd_file)) > seen + 2, 30, "a later fd count", procs)
            after_drop.append(fds_of(fd_file)[-1])
        assert max(after_drop) - min(after_drop) <= 2, f"fds after each drop: {after_drop}"
        assert len(read_batches(out)) < N // BATCH, "the epoch ended before the fakes came"

        fakes = []
        for i in range(20):
            peer = RawPeer(ctx, address, 0x6000 + i)
            names = [f"ipc://{tmp_path}/nobody-{i}-{j}" for j in range(W.MAX_ENDPOINTS)]
            peer.send(W.Kind.HELLO, payload=" ".join(names))
            fakes.append(peer)

        def beat() -> None:
            while not stop_beats.wait(0.1):
                for peer in fakes:
                    peer.send(W.Kind.BEAT, role=SERVER)
                    peer.drain()

        beats = threading.Thread(target=beat, daemon=True)
        beats.start()
        start = len(fds_of(fd_file))
        wait_until(lambda: len(fds_of(fd_file)) > start + 100, 60, "10 s of fd counts with the fakes", procs)
        real = start_server(tmp_path, dataset, address, "real")
        procs.append(real)
        pace.write_text("0")
        assert trainer.wait(90) == 0, logs(tmp_path, "t0", "d")
        assert d.wait(30) == 0, logs(tmp_path, "d")
    finally:
        stop_beats.set()
        stop(*procs)
        ctx.destroy(linger=0)
    counts = fds_of(fd_file)
    assert max(counts[start:]) <= max(after_drop) + 2 * 20 * W.MAX_ENDPOINTS + 40, (after_drop, max(counts))
    assert used([out]) == collections.Counter(range(N))
    assert served_by([out], real) > 0


def test_a_flood_of_fake_trainer_ids_is_counted_not_logged_line_by_line(tmp_path, dataset):
    """3,000 trainer ids that beat once each are all declared dead (the status counts them), and
    the dispatcher's log says so at most LOG_BURST times per 5 s window, not 3,000 times."""
    from crossfeed.net.lease.book import LOG_BURST

    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0")
    ctx = zmq.Context()
    try:
        start = time.monotonic()
        peer = RawPeer(ctx, address, sender=1)
        for i in range(3000):
            peer.sender = 0x10000 + i
            peer.send(W.Kind.BEAT, role=TRAINER, sent_ms=1)
        lost = lambda: getattr(status_of(address), "counters", {}).get("trainers_lost") == 3000  # noqa: E731
        wait_until(lost, 60, "3000 trainers declared dead", [d])
        elapsed = time.monotonic() - start
        assert d.poll() is None
    finally:
        ctx.destroy(linger=0)
        stop(d)
    lines = (tmp_path / "d.log").read_text().count("declared dead")
    assert 0 < lines <= LOG_BURST * (elapsed // 5 + 2), (lines, elapsed)


def test_a_message_whose_handling_breaks_is_dropped_and_the_dispatcher_answers_on(tmp_path):
    """A claim that meets a bug (the book raises a RuntimeError, standing in for any) is counted
    as dropped and logged; the dispatcher's loop lives on and answers the next BEAT."""
    options = DispatcherOptions(f"ipc://{tmp_path}/d.sock", tmp_path / "journal", heartbeat=Heartbeat(0.5, 30.0))
    ctx = zmq.Context()
    try:
        with LeaseDispatcher({"split": "train"}, 10, options) as d:

            def broken(*args, **kwargs):
                raise RuntimeError("a bug met on a peer's bytes")

            d.book.claim = broken
            trainer = RawPeer(ctx, d.endpoint, sender=0x78)
            trainer.send(W.Kind.BEAT, role=TRAINER, sent_ms=1)
            trainer.send(W.Kind.CLAIM, role=TRAINER, payload=[(0, 1)])
            trainer.send(W.Kind.BEAT, role=TRAINER, sent_ms=2)
            answers = []
            while len(answers) < 2 and trainer.sock.poll(10_000):
                answers.append(W.unpack(trainer.sock.recv_multipart(), W.TO_TRAINER).kind)
            assert answers == [W.Kind.SERVERS, W.Kind.SERVERS]
            assert d.stats["dropped_messages"] == 1 and d.error is None and not d.wait(0)
    finally:
        ctx.destroy(linger=0)
