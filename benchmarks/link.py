"""A slow network link for benchmarks: a TCP proxy in front of a local server (an HTTP file
server, moto's S3 server) that caps bandwidth — for the whole link and per connection, as object
stores cap one stream well below the NIC — and adds a latency to every request.

Every reader under test goes through the same link, so "epoch 1 as a share of the link's
bandwidth" means something: loopback alone moves gigabytes a second and hides latency.
"""

from __future__ import annotations

import socket
import threading
import time


class _Bucket:
    """A pacing clock: ``take(n)`` returns when ``n`` more bytes fit under ``rate`` bytes/s."""

    def __init__(self, rate: float):
        self.rate = rate
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + n / self.rate
            return self._next


class Link:
    """``Link(upstream_port, bandwidth, latency, per_connection)``: listens on ``127.0.0.1:port``
    and forwards to ``127.0.0.1:upstream_port``. Responses are paced at ``bandwidth`` bytes/s in
    all and ``per_connection`` bytes/s per connection; each request (a burst of bytes from the
    client after a response) waits ``latency`` seconds first (time to first byte)."""

    STEP = 1 << 16

    def __init__(self, upstream_port: int, bandwidth: float, latency: float, per_connection: float | None = None):
        self.upstream = upstream_port
        self.latency = latency
        self.per_connection = per_connection or bandwidth
        self._total = _Bucket(bandwidth)
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(256)
        self.port = self._sock.getsockname()[1]
        self.requests = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._up, args=(client, server), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        """Client → server: a request is delayed by the latency (only its first bytes wait)."""
        last = 0.0
        try:
            while data := src.recv(self.STEP):
                now = time.monotonic()
                if now - last > 0.001:  # a new request, not the rest of one
                    self.requests += 1
                    time.sleep(self.latency)
                last = time.monotonic()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _shut(dst)

    def _down(self, src: socket.socket, dst: socket.socket) -> None:
        """Server → client: paced by the link's and this connection's bandwidth."""
        mine = _Bucket(self.per_connection)
        try:
            while data := src.recv(self.STEP):
                done = max(self._total.reserve(len(data)), mine.reserve(len(data)))
                wait = done - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _shut(dst)


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
