"""Prometheus metrics of servers, dispatchers and training processes (`prometheus_client`).

    crossfeed serve ... --metrics 127.0.0.1:9400       # a server's counters
    crossfeed dispatch ... --metrics 127.0.0.1:9401    # the dispatcher's

    endpoint = crossfeed.metrics.serve(9402)           # in a training process
    for batch in endpoint.watch(loader_or_stream, rank=rank):
        ...
    endpoint.close()

Each endpoint has its own `CollectorRegistry` (never the process-global default): two in one
process never collide. What crossfeed already counts (a server's `stats`, the dispatcher's lease
book) is read at scrape time by a custom collector, so nothing is counted twice; what nothing
counted before (how long a training loop waits for each batch) is observed by `watch`.

The endpoint is plain, unauthenticated HTTP and binds 127.0.0.1 unless told otherwise: whoever
reaches it reads the counters (ids, addresses, rates; never data). An address other machines can
reach (a wildcard, an interface's) is refused unless `insecure=True` (`--insecure`) says the
network is trusted: the rule of `serve` and `dispatch` (`crossfeed.net.addresses.is_local`), or
put it behind a proxy that authenticates. It answers with WORKERS threads at most, QUEUED
connections wait for one (more are closed at once), and a connection that sends no complete
request within IDLE seconds is closed: idle connections cannot pin a thread each.

Metric names (`docs/serve-and-dispatch.md#metrics-and-crossfeed-top` lists them with their labels):
    crossfeed_batches_total, _samples_total, _bytes_total   delivered (server) / consumed (rank)
    crossfeed_stage_seconds_total{stage}                    a Loader's seconds per stage
    crossfeed_consumer_wait_seconds (histogram)             a training loop's wait for each batch
    crossfeed_cache_hits_total, _misses_total, _bytes_total a Loader's shard cache
    crossfeed_leases_held, _granted_total, _expired_total, crossfeed_batches_re_leased_total
    crossfeed_claims_total{result}, crossfeed_servers_alive, crossfeed_trainers_alive
    crossfeed_trainer_wait_ratio{trainer}                   a trainer's last reported wait share
    crossfeed_server_batches_per_second{endpoint}, crossfeed_server_share{endpoint}
                                                            a server's measured rate, its share of the fleet's
    crossfeed_batches_taken_over_total                      leased batches moved to a faster server
    crossfeed_errors_total{kind}
The stage, wait and cache metrics come from `crossfeed.net.status.loader_stats(loader)`: there
only, and only while the Loader reports them.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from crossfeed.errors import ConfigError, require
from crossfeed.net.addresses import is_local
from crossfeed.net.observe import batch_nbytes, batch_size
from crossfeed.net.status import DispatcherStatus, loader_stats, split_stats

logger = logging.getLogger(__name__)

# seconds a training loop waits for one batch: from a prefetched batch (~µs) to a stalled input
WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WORKERS = 4  # threads answering scrapes
QUEUED = 32  # accepted connections waiting for a thread, at most (more are closed at once)
IDLE = 5.0  # seconds a connection may take to send its request (and to read the answer)
_ADDRESS = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.-]*)):(?P<port>[0-9]{1,5})")


def _client():
    return require("prometheus_client", "Prometheus metrics (--metrics)")


def parse_address(text: str, option: str = "--metrics") -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT``; an empty host is 127.0.0.1; port 0: any free one)."""
    m = _ADDRESS.fullmatch(text.strip())
    if m is None or int(m["port"]) > 65535:
        raise ConfigError(f"{option} {text!r}: expected HOST:PORT such as 127.0.0.1:9400 (port 0: any free port)")
    return (m["v6"] or m["host"] or "127.0.0.1"), int(m["port"])


def check_address(host: str, port: int, *, insecure: bool, option: str = "--metrics") -> None:
    """ConfigError for an address other machines can reach, unless `insecure` (the rule every
    crossfeed listener follows: `crossfeed.net.addresses.is_local`); `MissingExtraError` when
    prometheus_client is not installed — both before anything starts."""
    shown = f"[{host}]" if ":" in host else host
    if not insecure and not is_local(f"tcp://{shown}:{port}"):
        raise ConfigError(
            f"refusing to serve metrics on {shown}:{port}: it is unauthenticated HTTP that other machines can "
            f"reach; bind 127.0.0.1 ({option} 127.0.0.1:{port}), put an authenticating proxy in front, or pass "
            "--insecure (insecure=True) on a trusted network"
        )
    _client()


def _server(port: int, addr: str, app: Any):
    """A WSGI server of WORKERS threads (see the module docstring); (server, its accept thread)."""
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

    class Handler(WSGIRequestHandler):
        timeout = IDLE  # a socket timeout on the request read and the answer write

        def log_message(self, *args: Any) -> None:  # scrapes are not news
            pass

    class Server(WSGIServer):
        address_family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
        request_queue_size = 128  # the listen backlog (socketserver's 5 makes a burst of clients wait seconds)

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="crossfeed-metrics")
            self._waiting = threading.BoundedSemaphore(WORKERS + QUEUED)

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self._waiting.acquire(blocking=False):
                self.shutdown_request(request)  # too many connections already: this one is closed
                return
            self._pool.submit(self._answer, request, client_address)

        def _answer(self, request: Any, client_address: Any) -> None:
            try:
                self.finish_request(request, client_address)
            except Exception as e:  # a peer that timed out or hung up: only its connection ends
                logger.debug("metrics connection from %s: %s", client_address, e)
            finally:
                self.shutdown_request(request)
                self._waiting.release()

        def server_close(self) -> None:
            super().server_close()
            self._pool.shutdown(wait=False, cancel_futures=True)

    httpd = Server((addr, port), Handler)
    httpd.set_app(app)
    thread = threading.Thread(target=httpd.serve_forever, name="crossfeed-metrics-accept", daemon=True)
    thread.start()
    return httpd, thread


class Endpoint:
    """One HTTP endpoint serving one registry (`serve` starts it); `close()` stops it."""

    def __init__(self, port: int = 0, addr: str = "127.0.0.1", *, insecure: bool = False):
        client = _client()
        check_address(addr, port, insecure=insecure)
        self.registry = client.CollectorRegistry(auto_describe=True)
        try:
            self._httpd, self._thread = _server(port, addr, client.make_wsgi_app(self.registry))
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {addr}:{port}: {e.strerror or e}") from e
        self.host, self.port = addr, int(self._httpd.server_port)
        self._watched: dict[str | tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        if not is_local(f"tcp://{'[' + addr + ']' if ':' in addr else addr}:{self.port}"):
            logger.warning(
                "metrics on %s:%d are unauthenticated HTTP: anyone who reaches it reads them", addr, self.port
            )
        logger.info("metrics (Prometheus) on %s", self.url)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def add(self, collector: Any) -> Any:
        """Register a collector (`ServerCollector`, `DispatcherCollector`, `LoaderCollector`)."""
        self.registry.register(collector)
        return collector

    def watch(self, batches: Iterable[Any], *, rank: int | str = 0) -> Iterator[Any]:
        """Iterate `batches` (a Loader, a `crossfeed.connect` stream, any iterable of batches;
        ``(meta, batch)`` pairs too), counting what the loop receives and timing how long each
        batch keeps it waiting, labelled ``rank``; a Loader's per-stage stats are collected too."""
        label = str(rank)
        metrics = self._trainer_metrics()
        if callable(getattr(batches, "stats", None)):  # a Loader that reports its stages
            with self._lock:
                if ("loader", label) not in self._watched:
                    self._watched["loader", label] = self.add(LoaderCollector(batches, rank=label))
        wait = metrics["wait"].labels(label)
        counts = [metrics[k].labels(label) for k in ("batches", "samples", "bytes")]
        it = iter(batches)
        while True:
            start = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            wait.observe(time.perf_counter() - start)
            batch = item[1] if isinstance(item, tuple) and len(item) == 2 else item
            counts[0].inc()
            if isinstance(batch, dict):
                counts[1].inc(batch_size(batch))
                counts[2].inc(batch_nbytes(batch))
            yield item

    def _trainer_metrics(self) -> dict[str, Any]:
        with self._lock:
            if "trainer" not in self._watched:
                c = _client()
                r = self.registry
                self._watched["trainer"] = {
                    "batches": c.Counter(
                        "crossfeed_batches", "Batches the training loop received", ["rank"], registry=r
                    ),
                    "samples": c.Counter(
                        "crossfeed_samples", "Samples the training loop received", ["rank"], registry=r
                    ),
                    "bytes": c.Counter(
                        "crossfeed_bytes", "Payload bytes the training loop received", ["rank"], registry=r
                    ),
                    "wait": c.Histogram(
                        "crossfeed_consumer_wait_seconds",
                        "Seconds the training loop waited for each batch",
                        ["rank"],
                        buckets=WAIT_BUCKETS,
                        registry=r,
                    ),
                }
            return self._watched["trainer"]

    def close(self) -> None:
        """Stop serving (the port is free when this returns)."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(port: int = 0, addr: str = "127.0.0.1", *, insecure: bool = False) -> Endpoint:
    """Serve Prometheus metrics on http://ADDR:PORT/metrics (port 0: any free one, see
    `Endpoint.port`) from a registry of this endpoint's own; unauthenticated, so loopback by
    default (another address needs `insecure=True`, see `check_address`). Feed it with
    `Endpoint.watch(batches, rank=...)`; `close()` when done."""
    return Endpoint(port, addr, insecure=insecure)


# ---- collectors: read at scrape time ----
def _family(kind: str, name: str, doc: str, labels: list[str]):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    return (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=labels)


def _loader_families(flat: dict[str, float] | None, names: list[str], values: list[str]) -> list:
    """The stage, wait and cache metrics of a Loader's flat stats (`split_stats`)."""
    if flat is None:
        return []
    split = split_stats(flat)
    stage = _family("counter", "crossfeed_stage_seconds", "Seconds the Loader spent in each stage", [*names, "stage"])
    for name, seconds in sorted(split.stages.items()):
        stage.add_metric([*values, name], seconds)
    out = [stage]
    if split.wait is not None:
        wait = _family("counter", "crossfeed_loader_wait_seconds", "Seconds the Loader's consumer waited", names)
        wait.add_metric(values, split.wait)
        out.append(wait)
    for what, value in sorted(split.cache.items()):
        f = _family("counter", f"crossfeed_cache_{what}", f"Shard cache {what}", names)
        f.add_metric(values, value)
        out.append(f)
    return out


class LoaderCollector:
    """A Loader's stage seconds, consumer wait and cache counts (from `loader_stats`), labelled."""

    def __init__(self, loader: Any, **labels: str):
        self._loader, self._labels = loader, labels

    def collect(self):
        yield from _loader_families(loader_stats(self._loader), list(self._labels), list(self._labels.values()))


class ServerCollector:
    """A `crossfeed serve` server's counters (`Server.stats`, its lease source's), labelled `server`."""

    def __init__(self, server: Any):
        self._server = server

    def collect(self):
        s = self._server
        stats, sid = dict(s.stats), [s.options.server_id]
        for key, name, doc in (
            (
                "delivered",
                "crossfeed_batches",
                "Batches delivered (acknowledged by a trainer, a copy its claim refused included; published in broadcast)",
            ),
            ("samples", "crossfeed_samples", "Samples of the batches delivered"),
            ("bytes", "crossfeed_bytes", "Payload bytes of the batches delivered"),
            ("sent", "crossfeed_batches_sent", "Batch sends, re-sends of a lost trainer's batches included"),
            ("epochs", "crossfeed_epochs", "Epochs completed"),
        ):
            f = _family("counter", name, doc, ["server"])
            f.add_metric(sid, stats[key])
            yield f
        filtered = _family(
            "counter", "crossfeed_samples_filtered", "Samples dropped by the filter (serve --filter)", ["server"]
        )
        filtered.add_metric(sid, s.filtered)
        yield filtered
        alive = _family("gauge", "crossfeed_trainers_alive", "Live trainers of this server", ["server"])
        alive.add_metric(sid, s.trainers())
        yield alive
        errors = _family("counter", "crossfeed_errors", "Errors by kind", ["server", "kind"])
        errors.add_metric([*sid, "malformed_message"], stats["dropped_messages"])
        errors.add_metric([*sid, "trainer_fenced"], stats["fenced"])
        lease_stats = s.source_stats
        if lease_stats is not None:
            errors.add_metric([*sid, "lease_reset"], lease_stats.get("resets", 0))
            errors.add_metric([*sid, "void_batch_dropped"], lease_stats.get("dropped", 0))
            leases = _family("counter", "crossfeed_leases_received", "Leases received from the dispatcher", ["server"])
            leases.add_metric(sid, lease_stats.get("leases", 0))
            yield leases
        yield errors
        yield from _loader_families(loader_stats(s.loader), ["server"], sid)


class DispatcherCollector:
    """A `crossfeed dispatch` dispatcher's lease book, from its `snapshot` (refreshed by its loop)."""

    def __init__(self, dispatcher: Any):
        self._dispatcher = dispatcher

    def collect(self):
        st = DispatcherStatus.parse(self._dispatcher.snapshot)
        c = st.counters

        def one(kind, name, doc, value):
            f = _family(kind, name, doc, [])
            f.add_metric([], value)
            return f

        yield one("counter", "crossfeed_leases_granted", "Leases granted to servers", c["leases"])
        yield one(
            "counter",
            "crossfeed_leases_expired",
            "Leases revoked: their server died, stalled or left, or a later lease of it overtook them",
            c["leases_revoked"],
        )
        yield one(
            "counter",
            "crossfeed_batches_re_leased",
            "Unclaimed batches of revoked leases, leased again",
            c["batches_re_leased"],
        )
        yield one(
            "counter",
            "crossfeed_batches_taken_over",
            "Leased batches taken over from a slow or stalled server by a faster one",
            c["batches_taken_over"],
        )
        claims = _family("counter", "crossfeed_claims", "Trainers' claims, granted or refused", ["result"])
        claims.add_metric(["granted"], c["granted"])
        claims.add_metric(["refused"], c["refused"])
        yield claims
        yield one("gauge", "crossfeed_servers_alive", "Live servers", st.servers_total)
        yield one("gauge", "crossfeed_trainers_alive", "Live trainers", st.trainers_total)
        yield one("gauge", "crossfeed_epoch", "The epoch in progress", st.epoch)
        state = _family("gauge", "crossfeed_epoch_batches", "Batches of the epoch by state", ["state"])
        for k, v in st.progress.items():
            state.add_metric([k], v)
        yield state
        held = _family("gauge", "crossfeed_leases_held", "Live leases a server holds", ["endpoint"])
        leased = _family("gauge", "crossfeed_leased_batches", "Batches leased to a server, unclaimed", ["endpoint"])
        claimed = _family("counter", "crossfeed_server_claims", "A live server's batches claimed", ["endpoint"])
        age = _family(
            "gauge", "crossfeed_heartbeat_age_seconds", "Seconds since a server's last heartbeat", ["endpoint"]
        )
        rate = _family(
            "gauge",
            "crossfeed_server_batches_per_second",
            "A live server's batches claimed per second over the last seconds (the dispatcher's measure)",
            ["endpoint"],
        )
        share = _family(
            "gauge", "crossfeed_server_share", "A live server's share of the fleet's batch rate", ["endpoint"]
        )
        for s in st.servers:
            endpoint = [s.address.split(" ")[0]]
            held.add_metric(endpoint, s.leases)
            leased.add_metric(endpoint, s.leased)
            claimed.add_metric(endpoint, s.claimed)
            age.add_metric(endpoint, s.age)
            if s.rate is not None:
                rate.add_metric(endpoint, s.rate)
            if s.share is not None:
                share.add_metric(endpoint, s.share)
        yield from (held, leased, claimed, age, rate, share)
        wait = _family(
            "gauge",
            "crossfeed_trainer_wait_ratio",
            "Share of its time a trainer's loop waited for batches, as it last reported (listed trainers that did)",
            ["trainer"],
        )
        for t in st.trainers:
            if t.wait is not None:
                wait.add_metric([t.id], t.wait)
        yield wait
        errors = _family("counter", "crossfeed_errors", "Errors by kind", ["kind"])
        errors.add_metric(["malformed_message"], c["dropped_messages"])
        errors.add_metric(["server_lost"], c["servers_lost"])
        errors.add_metric(["trainer_lost"], c["trainers_lost"])
        yield errors


def serve_server(server: Any, address: str) -> Endpoint:
    """`crossfeed serve --metrics ADDRESS`: an endpoint collecting `server` (a reachable ADDRESS
    needs the server's own --insecure)."""
    host, port = parse_address(address)
    endpoint = Endpoint(port, host, insecure=server.options.insecure)
    endpoint.add(ServerCollector(server))
    return endpoint


def serve_dispatcher(dispatcher: Any, address: str) -> Endpoint:
    """`crossfeed dispatch --metrics ADDRESS`: an endpoint collecting `dispatcher` (a reachable
    ADDRESS needs the dispatcher's own --insecure)."""
    host, port = parse_address(address)
    endpoint = Endpoint(port, host, insecure=dispatcher.options.insecure)
    endpoint.add(DispatcherCollector(dispatcher))
    return endpoint
