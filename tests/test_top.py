"""`crossfeed top` and the status query under it: a real terminal (tmux) against a real
dispatcher with two real servers, `--once` against a plain server, and hostile answers and
requests on both sides of the status protocol."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq
from dispatch_helpers import read_batches, spawn, start_dispatcher, start_fleet_dispatcher, start_server, write_dataset
from net_helpers import Synthetic, stop, wait_until

from crossfeed.errors import WireError
from crossfeed.net import status as S
from crossfeed.net.stream.server import Server, ServerOptions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # slow: crossfeed top in tmux, several servers
TMUX = shutil.which("tmux")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds"
    write_dataset(str(path), 96)
    return str(path)


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed")
def test_top_in_a_terminal_shows_both_servers_and_exits_on_ctrl_c(tmp_path, dataset):
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0")
    procs = [d]
    sock = str(tmp_path / "tmux.sock")  # a tmux server of this test's own
    tmux = [TMUX, "-S", sock]
    try:
        servers = [start_server(tmp_path, dataset, address, f"s{i}") for i in range(2)]
        procs += servers
        # the size comes from the terminal (a COLUMNS a shell exported while tmux was sizing the pane would pin it)
        command = f"unset COLUMNS LINES; {sys.executable} -m crossfeed.cli.main top {address}; echo EXIT=$?; sleep 60"
        subprocess.run([*tmux, "new-session", "-d", "-x", "160", "-y", "40", "-s", "top", command], check=True)

        def pane() -> str:
            return subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True).stdout

        def shows(*texts: str) -> str | None:
            screen = pane()
            return screen if all(t in screen for t in texts) else None

        ids = [f":{s.pid}" for s in servers]  # server ids are host:pid
        try:
            screen = wait_until(lambda: shows(*ids, "servers 2"), 60, "both servers on screen", procs)
        except AssertionError as e:
            raise AssertionError(f"{e}; the screen:\n{pane()}") from None
        for column in ("batches/s", "leases", "leased", "last beat", "stages", "trainer", "slowest server"):
            assert column in screen, screen
        assert "servers 2" in screen, screen
        subprocess.run([*tmux, "send-keys", "-t", "top", "C-c"], check=True)
        screen = wait_until(lambda: shows("EXIT="), 30, "top to exit", procs)
        assert "EXIT=0" in screen and "Traceback" not in screen, screen
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        stop(*procs)


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed")
def test_top_in_a_terminal_names_the_slow_server_and_shows_the_fast_ones_rate(tmp_path):
    """A fast server and a slow one (10 ms a sample, asleep) under `dispatch` at its defaults, one
    unpaced trainer: every frame that names a slowest server names the slow one (the issue saw
    the idle fast one named), and the fast one's row shows its rate."""
    path = tmp_path / "ds"
    write_dataset(str(path), 4000)  # 1,000 batches an epoch: the frames fall inside epochs mostly
    d, address = start_fleet_dispatcher(tmp_path, str(path), "d", "--epochs", "1000")
    procs = [d]
    sock = str(tmp_path / "tmux.sock")
    tmux = [TMUX, "-S", sock]
    try:
        fast = start_server(tmp_path, str(path), address, "fast")
        slow = start_server(tmp_path, str(path), address, "slow", "--transform", "dispatch_helpers:slow")
        procs += [fast, slow]
        logs = [tmp_path / "fast.log", tmp_path / "slow.log"]
        wait_until(lambda: all("joined the dispatcher" in x.read_text() for x in logs), 60, "the servers", procs)
        out = tmp_path / "t.out"
        procs.append(spawn("trainer", address, str(out), 0.0, log=tmp_path / "t.log"))
        wait_until(lambda: read_batches(out), 60, "a first batch", procs)
        command = f"unset COLUMNS LINES; {sys.executable} -m crossfeed.cli.main top {address}; sleep 60"
        subprocess.run([*tmux, "new-session", "-d", "-x", "160", "-y", "40", "-s", "top", command], check=True)

        def pane() -> str:
            return subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True).stdout

        def rate_of(screen: str, proc) -> float | None:  # the batches/s cell of its row
            for line in screen.splitlines():
                if f":{proc.pid} " in line and "│" in line and "slowest" not in line:
                    cell = line.split("│")[3].strip()
                    return float(cell) if cell.replace(".", "", 1).isdigit() else None
            return None

        def naming_slow() -> str | None:
            screen = pane()
            return screen if f"slowest server: {socket.gethostname()}:{slow.pid} " in screen else None

        screen = wait_until(naming_slow, 60, "the slow server named", procs)

        def whole_frame() -> str | None:  # not one caught while top redraws it
            screen = pane()
            return screen if screen.count("└") >= 2 and "dispatcher " in screen else None

        frames = [screen]
        for _ in range(3):
            time.sleep(1.5)
            frames.append(wait_until(whole_frame, 30, "a whole frame", procs))
        for screen in frames:
            named = re.findall(r"^slowest server: \S+:(\d+) \(", screen, re.M)
            assert all(pid == str(slow.pid) for pid in named), screen  # never the fast one
            fast_rate, slow_rate = rate_of(screen, fast), rate_of(screen, slow)
            assert fast_rate is not None and slow_rate is not None and fast_rate > slow_rate, screen
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        stop(*procs)


def test_top_once_against_a_plain_server(tmp_path):
    with Server(Synthetic(64, 8), ServerOptions(("tcp://127.0.0.1:0",), server_id="prep-7")) as server:
        out = subprocess.run(
            [sys.executable, "-m", "crossfeed.cli.main", "top", server.endpoints[0], "--once"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 0, out.stderr
    assert "server prep-7 at" in out.stdout and "batches/s" in out.stdout, out.stdout


def test_top_gives_the_verdict_of_a_served_loader(tmp_path, dataset):
    from crossfeed import connect
    from crossfeed.net.run import LoaderEpochs
    from crossfeed.read.options import LoaderOptions

    factory = LoaderEpochs(dataset, LoaderOptions.of(batch_size=8, num_threads=1))
    try:
        with Server(factory, ServerOptions(("tcp://127.0.0.1:0",), server_id="prep-9", epochs=None)) as server:
            with connect(server.endpoints[0], connect_timeout=10.0) as stream:
                for n, _ in enumerate(stream, 1):
                    if n == 6:
                        break
            out = subprocess.run(
                [sys.executable, "-m", "crossfeed.cli.main", "top", server.endpoints[0], "--once"],
                capture_output=True,
                text=True,
                timeout=60,
            )
    finally:
        factory.close()
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # rich wraps long lines
    # the served Loader's own verdict, either way its trainer's timing went (the server's consumer
    # waited on its Loader, or not: then no stage is named)
    assert "verdict:" in text and ("of build time" in text or "not input-bound: the trainer waited" in text), out.stdout


def test_a_verdict_comes_from_the_flat_stats_of_the_interval():
    flat = {"batches": 10, "samples": 80, "wait_seconds": 4.0, "consumer_seconds": 1.0, "threads": 2}
    flat |= {"stage_decode_seconds": 3.0, "stage_decode_count": 10, "stage_read_seconds": 1.0, "stage_read_count": 10}
    assert S.loader_verdict(flat).startswith("input-bound") and "decode takes 75%" in S.loader_verdict(flat)
    later = dict(flat, batches=20, wait_seconds=4.1, consumer_seconds=9.0)
    assert S.loader_verdict(later, flat).startswith("not input-bound")  # the interval, not the whole life
    assert S.loader_verdict(None) is None and S.loader_verdict({"batches": 0}) is None


def test_top_names_an_address_that_does_not_answer(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "crossfeed.cli.main", "top", f"ipc://{tmp_path}/nobody", "--once", "--timeout", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "no status from ipc://" in out.stderr and "--keys" in out.stderr, out.stderr


def _dispatcher_status(**changes) -> dict:
    obj = {
        "v": 1,
        "kind": "dispatcher",
        "uptime": 3.5,
        "epoch": 0,
        "epochs": 1,
        "batches": 24,
        "finished": False,
        "progress": {"pending": 1, "leased": 2, "claimed": 3, "done": 18},
        "counters": dict.fromkeys(S.DispatcherStatus.COUNTERS, 0),
        "servers": [
            {"id": "00000000000000ab", "address": "tcp://h:1", "age": 0.1, "leases": 1, "leased": 2, "claimed": 3}
        ],
        "servers_total": 1,
        "trainers": [{"id": "00000000000000cd", "age": 0.2, "claimed": 4, "holding": 1}],
        "trainers_total": 1,
    }
    obj.update(changes)
    return obj


@pytest.mark.parametrize(
    "changes",
    [
        {"epoch": -1},
        {"epoch": True},
        {"uptime": 1e300},
        {"uptime": "3"},
        {"finished": 1},
        {"progress": {"pending": 1}},
        {"counters": {}},
        {"servers": [{"id": "zz", "address": "a", "age": 0, "leases": 0, "leased": 0, "claimed": 0}]},
        {
            "servers": [
                {"id": "00000000000000ab", "address": "a\x1b[2J", "age": 0, "leases": 0, "leased": 0, "claimed": 0}
            ]
        },
        {"servers": [{"id": "00000000000000ab", "address": "a", "age": 0, "leases": 0, "leased": 0}]},
        {"servers": [{}] * (S.MAX_LISTED + 1)},
        {"trainers": "x"},
        {"trainers": [{"id": "00000000000000cd", "age": 0.2, "claimed": 4, "holding": 1, "wait": 1.5, "wait_age": 1}]},
        {"trainers": [{"id": "00000000000000cd", "age": 0.2, "claimed": 4, "holding": 1, "wait": -0.1, "wait_age": 1}]},
        {"trainers": [{"id": "00000000000000cd", "age": 0.2, "claimed": 4, "holding": 1, "wait": True, "wait_age": 1}]},
        {
            "trainers": [
                {"id": "00000000000000cd", "age": 0.2, "claimed": 4, "holding": 1, "wait": "38%", "wait_age": 1}
            ]
        },
        {"trainers": [{"id": "00000000000000cd", "age": 0.2, "claimed": 4, "holding": 1, "wait": 0.5}]},
        {"trainers": [{"id": "00000000000000cd", "age": 0.2, "claimed": 4, "holding": 1, "wait": None, "wait_age": 1}]},
        {"trainers_total": 2**63},
    ],
)
def test_a_dispatcher_status_is_checked_field_by_field(changes):
    S.DispatcherStatus.parse(_dispatcher_status())  # the unchanged one is fine
    waits = [
        {"id": "00000000000000cd", "age": 0.2, "claimed": 4, "holding": 1, "wait": w, "wait_age": a}
        for w, a in ((0, 0.5), (1, 7.0), (0.38, 0), (None, None))
    ]
    got = S.DispatcherStatus.parse(_dispatcher_status(trainers=waits)).trainers
    assert [(t.wait, t.wait_age) for t in got] == [(0.0, 0.5), (1.0, 7.0), (0.38, 0.0), (None, None)]
    assert S.DispatcherStatus.parse(_dispatcher_status()).trainers[0].wait is None  # an older dispatcher's
    with pytest.raises(WireError, match="dispatcher status"):
        S.DispatcherStatus.parse(_dispatcher_status(**changes))


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe", b"[" * 100000, b'{"v": 1, "kind": "server", "uptime": NaN}', b"[]", b'{"v": 2, "kind": "server"}'],
)
def test_a_status_answer_that_is_not_json_of_the_protocol_is_refused(raw):
    with pytest.raises(WireError, match="status answer"):
        S._object(raw)


def test_a_server_answers_status_and_drops_malformed_and_flooding_requests():
    with Server(Synthetic(64, 8), ServerOptions(("tcp://127.0.0.1:0",), server_id="prep-1")) as server:
        status = S.parse_status(S.query(server.endpoints[0]))
        assert isinstance(status, S.ServerStatus) and status.server_id == "prep-1" and status.delivered == 0
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(server.endpoints[0])
        bad = bytearray(S.pack_request(5))
        bad[5] = S.ANSWER  # an answer sent as a request
        sock.send(bytes(bad))
        wait_until(lambda: server.stats["dropped_messages"] == 1, 10, "the malformed request dropped")
        for i in range(60):  # a flood: at most RATE a second are answered
            sock.send(S.pack_request(100 + i))
        answers = []
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if sock.poll(100):
                frames = sock.recv_multipart()
                answers.append(json.loads(frames[1]))
        sock.close()
        ctx.term()
        assert 1 <= len(answers) < 60 and all(a["server_id"] == "prep-1" for a in answers)
        assert S.parse_status(S.query(server.endpoints[0])).dropped_messages == 1  # and it still answers


def test_top_shows_each_trainers_wait_share_the_eager_one_above_the_sleeping_one(tmp_path, dataset):
    from dispatch_helpers import spawn

    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0", "--epochs", "1000")
    procs = [d]
    try:
        server = start_server(tmp_path, dataset, address, "s0")
        procs.append(server)
        ids = {}
        for name, pace in (("sleepy", 0.3), ("eager", 0.0)):  # the sleeper's own step is long: it waits little
            procs.append(
                spawn("timed_trainer", address, str(tmp_path / f"{name}.id"), pace, log=tmp_path / f"{name}.log")
            )
        for name in ("sleepy", "eager"):
            path = tmp_path / f"{name}.id"
            ids[name] = wait_until(lambda p=path: p.exists() and p.read_text(), 60, f"the {name} trainer's id", procs)

        def reported():
            time.sleep(0.1)  # at most RATE status answers a second
            st = S.DispatcherStatus.parse(S.query(address))
            waits = {t.id: t.wait for t in st.trainers}
            return waits if all(waits.get(i) is not None for i in ids.values()) else None

        waits = wait_until(reported, 60, "both trainers' wait shares", procs)
        sleepy, eager = waits[ids["sleepy"]], waits[ids["eager"]]
        assert 0 <= sleepy < eager <= 1, waits
        out = subprocess.run(
            [sys.executable, "-m", "crossfeed.cli.main", "top", address, "--once"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**__import__("os").environ, "COLUMNS": "250"},
        )
    finally:
        stop(*procs)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    shown = {}
    for name, tid in ids.items():
        row = next(line for line in lines if tid in line)
        pct = [c for c in row.split() if c.endswith("%")]
        assert pct, row
        shown[name] = int(pct[0][:-1])
    assert 0 <= shown["sleepy"] < shown["eager"] <= 100, out.stdout
    bound = [line for line in lines if line.startswith("input-bound:")]
    if shown["eager"] >= 10:  # the eager trainer waits on the one server: named
        assert bound and ids["eager"] in bound[0] and f":{server.pid}" in bound[0], out.stdout
    else:
        assert not bound, out.stdout


def _frame(waits: list[tuple[float | None, float | None]]) -> str:
    from rich.console import Console

    from crossfeed.cli.top import Snapshot, render

    trainers = [
        {"id": f"{i + 1:016x}", "age": 0.1, "claimed": 1, "holding": 0, "wait": w, "wait_age": a}
        for i, (w, a) in enumerate(waits)
    ]
    st = S.DispatcherStatus.parse(_dispatcher_status(trainers=trainers, trainers_total=len(trainers)))
    server = S.ServerStatus("prep-3", 10.0, 50, 400, 4000, 50, 0, 2, 0, 0, True, None)
    console = Console(record=True, width=250)
    console.print(render("tcp://d:1", Snapshot(0.0, st, {"tcp://h:1": server}), None))
    return console.export_text()


def test_the_trainers_table_shows_wait_shares_and_an_input_bound_fleet_names_its_slowest_server():
    text = _frame([(0.38, 0.5), (0.02, 12.0), (None, None)])
    rows = {f"{i:016x}": next(line for line in text.splitlines() if f"{i:016x}" in line) for i in (1, 2, 3)}
    assert "38%" in rows["0000000000000001"] and "2% (12s ago)" in rows["0000000000000002"], text
    assert "not reported" in rows["0000000000000003"], text
    bound = [line for line in text.splitlines() if line.startswith("input-bound:")]
    assert len(bound) == 1 and "0000000000000001 38%" in bound[0] and "prep-3 (tcp://h:1)" in bound[0], text
    calm = _frame([(0.09, 0.5), (None, None)])
    assert "9%" in calm and "input-bound" not in calm, calm


HOSTILE = ["ipc://[/x]", "ipc://[link=http://evil.example]click[/link]", "ipc://[reverse]x"]


def test_top_shows_endpoints_a_peer_registered_as_inert_text(tmp_path, dataset):
    """Raw peers register endpoints that are rich markup (a stray closing tag, an OSC 8
    hyperlink, a style) with a real dispatcher: `crossfeed top --once`, in a colour terminal,
    prints each literally, with no hyperlink escape and no traceback."""
    from crossfeed.net.lease import messages as W

    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0")
    ctx = zmq.Context()
    try:
        peers = []
        for i, endpoint in enumerate(HOSTILE):
            peer = ctx.socket(zmq.DEALER)
            peer.linger = 0
            peer.connect(address)
            peer.send_multipart(W.pack(W.Kind.HELLO, sender=0x5000 + i, payload=endpoint))
            peers.append(peer)

        stop_beats = threading.Event()

        def beat() -> None:  # the peers beat on (else they are declared dead) until top has run
            while not stop_beats.wait(0.1):
                for i, peer in enumerate(peers):
                    peer.send_multipart(W.pack(W.Kind.BEAT, sender=0x5000 + i, role=1))
                    while peer.poll(0):
                        peer.recv_multipart()

        beats = threading.Thread(target=beat, daemon=True)
        beats.start()
        try:

            def registered() -> bool:  # polled gently: the dispatcher answers 20 status requests a second
                time.sleep(0.1)
                return S.DispatcherStatus.parse(S.query(address, timeout=5)).servers_total == 3

            wait_until(registered, 30, "3 registrations", [d])
            env = {"FORCE_COLOR": "1", "TERM": "xterm-256color", "COLUMNS": "250", "PATH": "/usr/bin:/bin"}
            out = subprocess.run(
                [sys.executable, "-m", "crossfeed.cli.main", "top", address, "--once", "--timeout", "10"],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
        finally:
            stop_beats.set()
            beats.join(10)
    finally:
        ctx.destroy(linger=0)
        stop(d)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "\x1b[" in out.stdout, "not a colour terminal: the test proves nothing"
    assert "\x1b]8;" not in out.stdout, repr(out.stdout)  # no OSC 8 hyperlink
    plain = S.re.sub(r"\x1b\[[0-9;]*m", "", out.stdout)
    for endpoint in HOSTILE:
        assert endpoint in plain, plain


def test_control_characters_a_peer_names_never_reach_the_terminal():
    """A status whose names carry an ESC sequence, a carriage return and markup (what a peer
    might send past a future check): the frame shows their printable rest only, and no ESC
    but rich's own colour codes."""
    import io

    from rich.console import Console

    from crossfeed.cli.top import Snapshot, render

    evil = "ipc://x\x1b]8;;http://evil\x1b\\click\x1b]8;;\x1b\\\r[/x]"
    entry = S.ServerEntry("00000000000000ab", evil, 0.1, 1, 2, 3)
    st = S.DispatcherStatus.parse(_dispatcher_status())
    st = S.dataclasses.replace(st, servers=(entry,))
    server = S.ServerStatus("prep\x1b[2J-3[link=x]", 10.0, 50, 400, 4000, 50, 0, 2, 0, 0, True, None)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="truecolor", width=250)
    console.print(render("tcp://d:1", Snapshot(0.0, st, {evil.split(" ")[0]: server}), None))
    text = out.getvalue()
    assert "\x1b]" not in text and "\r" not in text and "\x1b[2J" not in text, repr(text)
    plain = S.re.sub(r"\x1b\[[0-9;]*m", "", text)
    assert "ipc://x]8;;http://evil\\click]8;;\\[/x]" in plain and "prep[2J-3[link=x]" in plain, plain


def _fleet_frame(servers: list[dict], wait: float = 0.4) -> str:
    """A dispatcher's frame with these server entries (the dispatcher's rates and shares) and
    one trainer waiting `wait` of its time."""
    from rich.console import Console

    from crossfeed.cli.top import Snapshot, render

    trainers = [{"id": "0000000000000001", "age": 0.1, "claimed": 1, "holding": 0, "wait": wait, "wait_age": 0.5}]
    st = S.DispatcherStatus.parse(
        _dispatcher_status(servers=servers, servers_total=len(servers), trainers=trainers, trainers_total=1)
    )
    console = Console(record=True, width=250)
    console.print(render("tcp://d:1", Snapshot(0.0, st, {}), None))
    return console.export_text()


def _server(n: int, leased: int, rate: float | None, share: float | None) -> dict:
    return {
        "id": f"{n:016x}",
        "address": f"tcp://h:{n}",
        "age": 0.1,
        "leases": int(leased > 0),
        "leased": leased,
        "claimed": 10,
        "rate": rate,
        "share": share,
    }


def test_the_slowest_server_is_the_lowest_rate_among_those_holding_work_and_the_input_bound_line_says_fix_it():
    """The fast server, idle in this frame (it holds no lease), is never named; the one holding
    work at 2 batches/s is, with its rate and share, and the advice is to fix it."""
    text = _fleet_frame([_server(1, 0, 380.0, 0.95), _server(2, 6, 2.0, 0.005), _server(3, 40, 20.0, 0.045)])
    rows = {n: next(line for line in text.splitlines() if f"{n:016x}" in line) for n in (1, 2, 3)}
    assert "380.0" in rows[1] and "95%" in rows[1], text  # the fast one's rate and share are shown
    assert "2.0" in rows[2] and "0%" in rows[2] and "4%" in rows[3], text
    slow = [line for line in text.splitlines() if line.startswith("slowest server:")]
    assert slow == ["slowest server: 0000000000000002 (tcp://h:2) at 2.0 batches/s"], text
    (bound,) = [line for line in text.splitlines() if line.startswith("input-bound:")]
    assert "0000000000000002 (tcp://h:2) at 2.0 batches/s" in bound and "fix it" in bound, text
    assert "add servers" not in bound


def test_servers_at_even_rates_are_told_to_add_servers_and_an_idle_fleet_names_no_culprit():
    text = _fleet_frame([_server(1, 8, 100.0, 0.5), _server(2, 8, 90.0, 0.45), _server(3, 0, None, None)])
    (bound,) = [line for line in text.splitlines() if line.startswith("input-bound:")]
    assert "0000000000000002" in bound and "add servers" in bound and "fix" not in bound, text
    idle = _fleet_frame([_server(1, 0, 100.0, 0.5), _server(2, 0, 90.0, 0.5)])
    assert "slowest server: — (none holds work)" in idle, idle
    assert "0000000000000002 (tcp" not in idle, idle


@pytest.mark.parametrize("bad", [{"rate": -1.0}, {"rate": float("inf")}, {"rate": "3"}, {"share": 1.5}])
def test_a_servers_rate_and_share_are_checked_and_an_older_dispatcher_sends_none(bad):
    entry = _server(1, 2, 3.0, 0.5)
    got = S.DispatcherStatus.parse(_dispatcher_status(servers=[entry])).servers[0]
    assert (got.rate, got.share) == (3.0, 0.5)
    old = S.DispatcherStatus.parse(_dispatcher_status()).servers[0]  # no rate, share, nor newer counters
    assert (old.rate, old.share) == (None, None)
    assert S.DispatcherStatus.parse(_dispatcher_status()).counters["batches_taken_over"] == 0
    with pytest.raises(WireError, match="dispatcher status"):
        S.DispatcherStatus.parse(_dispatcher_status(servers=[{**entry, **bad}]))
