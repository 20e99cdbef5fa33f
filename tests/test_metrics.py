"""Prometheus metrics (`crossfeed.metrics`): a real Prometheus server scrapes a real dispatcher,
two real servers and a real trainer, and what it stores equals what the trainer received."""

from __future__ import annotations

import collections
import json
import signal
import urllib.error
import urllib.request

import pytest
from dispatch_helpers import start_dispatcher, start_server, write_dataset
from metrics_helpers import PROMETHEUS, metrics_port, prometheus_query, spawn, start_prometheus
from net_helpers import stop, wait_until

import crossfeed
import crossfeed.metrics
from crossfeed.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # slow: a real Prometheus server

N, BATCH = 96, 4  # 24 batches


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds"
    write_dataset(str(path), N)
    return str(path)


def _total(port: int, query: str) -> float | None:
    result = prometheus_query(port, query)
    return float(result[0]["value"][1]) if result else None


@pytest.mark.skipif(
    not PROMETHEUS.exists(), reason="Debian's prometheus server is not installed at /usr/bin/prometheus"
)
def test_prometheus_stores_what_the_trainer_received(tmp_path, dataset):
    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0", "--metrics", "127.0.0.1:0", "--linger", "120")
    procs = [d]
    try:
        servers = [
            start_server(tmp_path, dataset, address, f"s{i}", "--metrics", "127.0.0.1:0", "--metrics-linger", "120")
            for i in range(2)
        ]
        procs += servers
        out, port_file, release = tmp_path / "t.out", tmp_path / "t.port", tmp_path / "release"
        trainer = spawn("watched_trainer", address, str(out), str(port_file), str(release), log=tmp_path / "t.log")
        procs.append(trainer)
        logs = [tmp_path / "d.log", tmp_path / "s0.log", tmp_path / "s1.log"]
        ports = [
            wait_until(lambda log=log: metrics_port(log), 60, f"the metrics port in {log.name}", procs) for log in logs
        ]
        ports.append(
            int(wait_until(lambda: port_file.exists() and port_file.read_text(), 60, "the trainer's port", procs))
        )
        prom, prom_port = start_prometheus(tmp_path, ports)
        procs.append(prom)
        wait_until(lambda: out.exists() and out.read_text().endswith("END\n"), 90, "the trainer's epoch", procs)
        lines = out.read_text().splitlines()[:-1]
        received = [json.loads(line) for line in lines]
        samples = sum(len(b) for b in received)
        assert collections.Counter(i for b in received for i in b) == collections.Counter(range(N))
        want = {
            "crossfeed_samples_total{rank='0'}": samples,  # the trainer's own endpoint
            "crossfeed_batches_total{rank='0'}": len(received),
            "crossfeed_consumer_wait_seconds_count{rank='0'}": len(received),
            "crossfeed_claims_total{result='granted'}": len(received),  # the dispatcher
            "crossfeed_epoch_batches{state='done'}": N // BATCH,
            "crossfeed_servers_alive": 0,  # told FINISHED, both said BYE
        }

        def stored():
            got = {q: _total(prom_port, q) for q in want}
            return got if got == {q: float(v) for q, v in want.items()} else None

        try:
            wait_until(stored, 60, "Prometheus to store the final counts", [prom])
        except AssertionError:
            raise AssertionError(
                f"Prometheus holds { ({q: _total(prom_port, q) for q in want}) }, want {want}; "
                + (tmp_path / "prometheus.log").read_text()[-2000:]
            ) from None
        # labelled by server id; over the last minute, since one scrape that timed out on a loaded
        # machine marks that server's series stale until the next
        by_server = "last_over_time(crossfeed_batches_total{server!=''}[1m])"
        try:
            wait_until(lambda: len(prometheus_query(prom_port, by_server)) == 2, 30, "a series per server", [prom])
        except AssertionError:
            raise AssertionError(
                f"want a series per server, Prometheus holds {prometheus_query(prom_port, by_server)}"
            ) from None
        assert _total(prom_port, "sum(crossfeed_errors_total)") == 0.0
        # leases of at most 2 batches (of 1 at the epoch's tail, or sized down to a server's rate),
        # each batch leased once, plus those leased again (expired, or taken over by a faster server)
        granted = _total(prom_port, "sum(crossfeed_leases_granted_total)")
        again = _total(prom_port, "sum(crossfeed_batches_re_leased_total)")
        again += _total(prom_port, "sum(crossfeed_batches_taken_over_total)")
        assert N // BATCH // 2 <= granted <= N // BATCH + again, (granted, again)
        # the two servers' delivered batches: every batch the trainer used, plus the copy of one taken
        # over from the slower server that also reached the trainer (its claim refused, so unused)
        served = _total(prom_port, "sum(crossfeed_batches_total{server!=''})")
        assert len(received) <= served <= len(received) + again, (served, again)
        served_samples = _total(prom_port, "sum(crossfeed_samples_total{server!=''})")
        assert samples <= served_samples <= samples + again * BATCH, (served_samples, again)
        release.write_text("")
        for s in servers:  # the stream ended: they linger for the scrape until told to stop
            s.send_signal(signal.SIGTERM)
            assert s.wait(30) == 0
        assert trainer.wait(30) == 0
    finally:
        stop(*procs)


def test_a_training_process_endpoint_counts_a_loader_and_shuts_down(tmp_path, dataset):
    with crossfeed.metrics.serve(0) as a, crossfeed.metrics.serve(0) as b:  # each its own registry
        assert a.port != b.port and a.host == "127.0.0.1"
        with crossfeed.Loader(dataset, batch_size=8) as loader:
            seen = sum(len(batch["label"]) for batch in a.watch(loader, rank=3))
        assert seen == N
        text = urllib.request.urlopen(a.url, timeout=5).read().decode()
        assert f'crossfeed_samples_total{{rank="3"}} {float(N)}' in text, text
        assert f'crossfeed_batches_total{{rank="3"}} {float(N // 8)}' in text
        assert f'crossfeed_consumer_wait_seconds_count{{rank="3"}} {float(N // 8)}' in text
        assert "crossfeed_samples_total" not in urllib.request.urlopen(b.url, timeout=5).read().decode()
        stats = loader.stats()  # the Loader's own stage seconds, exported as they are
        for stage, got in stats.stages.items():
            assert f'crossfeed_stage_seconds_total{{rank="3",stage="{stage}"}} {float(got.seconds)}' in text
        assert 'stage="consumer"' not in text and 'stage="elapsed"' not in text  # not stages
        assert f'crossfeed_loader_wait_seconds_total{{rank="3"}} {float(stats.wait_seconds)}' in text
        url = a.url
    with pytest.raises(urllib.error.URLError):  # closed: the port no longer answers
        urllib.request.urlopen(url, timeout=5)


@pytest.mark.parametrize("bad", ["9400", "host:port", "127.0.0.1:70000", "http://127.0.0.1:9400", ""])
def test_a_bad_metrics_address_is_refused_naming_the_option(bad):
    with pytest.raises(ConfigError, match="--metrics"):
        crossfeed.metrics.parse_address(bad)


def test_serve_metrics_rejects_a_bad_address_before_serving(tmp_path, dataset):
    from typer.testing import CliRunner

    from crossfeed.cli.main import app

    result = CliRunner().invoke(app, ["serve", dataset, "tcp://127.0.0.1:0", "--metrics", "nope"])
    assert result.exit_code == 2 and "--metrics 'nope'" in result.output, result.output


def test_a_dispatcher_exports_each_trainers_wait_share(tmp_path, dataset):
    import struct
    import time

    import zmq

    from crossfeed.net.lease import messages as W

    d, address = start_dispatcher(tmp_path, dataset, "tcp://127.0.0.1:0", "--metrics", "127.0.0.1:0")
    ctx = zmq.Context()
    try:
        port = wait_until(lambda: metrics_port(tmp_path / "d.log"), 60, "the dispatcher's metrics port", [d])
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(address)
        beat = [(9, W.encode_wait(0.25)), (10, 0)]  # trainer 9 reports 25%, trainer 10 nothing

        def scraped():
            for sender, wait in beat:
                sock.send(struct.pack("<4sBBHqqqQQ", W.MAGIC, W.VERSION, int(W.Kind.BEAT), 0, 1, wait, 2, sender, 0))
            time.sleep(0.1)
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return text if "crossfeed_trainers_alive 2.0" in text and "crossfeed_trainer_wait_ratio{" in text else None

        text = wait_until(scraped, 30, "trainer 9's wait share in /metrics", [d])
    finally:
        ctx.destroy(linger=0)
        stop(d)
    assert "# TYPE crossfeed_trainer_wait_ratio gauge" in text, text
    assert 'crossfeed_trainer_wait_ratio{trainer="0000000000000009"} 0.25' in text, text
    assert 'trainer="000000000000000a"' not in text, text  # never reported: no sample


def test_metrics_on_an_address_other_machines_reach_needs_insecure_like_serve_and_dispatch(tmp_path, dataset):
    """One rule for every listener (`crossfeed.net.addresses.is_local`): a wildcard metrics
    address is refused without --insecure / insecure=True, by the library and by both commands,
    before anything starts; loopback needs nothing."""
    from typer.testing import CliRunner

    from crossfeed.cli.main import app

    for addr in ("0.0.0.0", "::"):
        with pytest.raises(ConfigError, match="insecure"):
            crossfeed.metrics.serve(0, addr)
    with crossfeed.metrics.serve(0, "0.0.0.0", insecure=True) as endpoint:
        assert urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=10).status == 200
    with crossfeed.metrics.serve(0, "127.0.0.2") as endpoint:  # loopback: no flag needed
        assert endpoint.port > 0
    journal = str(tmp_path / "journal")
    for argv in (
        ["serve", dataset, "tcp://127.0.0.1:0", "--metrics", "0.0.0.0:0"],
        ["dispatch", dataset, "tcp://127.0.0.1:0", "--journal", journal, "--metrics", "0.0.0.0:0"],
    ):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code != 0 and "--insecure" in result.output, result.output
        assert "refusing to serve metrics on 0.0.0.0:0" in result.output, result.output
    assert not (tmp_path / "journal").exists()  # refused before the dispatcher started


def test_idle_connections_do_not_hold_a_thread_each_and_scrapes_go_on(tmp_path):
    """300 connections that never send a request: the endpoint's threads stay at its few
    workers (it closes what it cannot queue, and each idle one after IDLE s), and once they
    are gone a scrape is answered."""
    import socket
    import threading

    with crossfeed.metrics.serve(0) as endpoint:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=30) for _ in range(300)]
        try:
            for s in idle:
                s.setblocking(False)

            def closed_by_the_server() -> int:
                n = 0
                for s in idle:
                    try:
                        n += s.recv(1) == b""
                    except BlockingIOError:
                        pass
                    except OSError:
                        n += 1
                return n

            wait_until(lambda: closed_by_the_server() >= 300 - crossfeed.metrics.QUEUED - 8, 60, "the surplus closed")
            assert threading.active_count() - before <= crossfeed.metrics.WORKERS + 1
        finally:
            for s in idle:
                s.close()
        # the closed ones free their slots as the workers read their ends: until then (a loaded machine
        # takes a moment) a scrape may still be one the endpoint has no room for, and is closed at once
        answers: list[str] = []

        def scraped() -> bool:
            try:
                answers.append(urllib.request.urlopen(endpoint.url, timeout=60).read().decode())
            except (ConnectionError, urllib.error.URLError):
                return False
            return True

        wait_until(scraped, 60, "a scrape answered once the idle connections are gone")
        assert "# HELP" in answers[-1] or answers[-1] == "", answers[-1]
