"""A static file server with HTTP Range support on 127.0.0.1:0, what fsspec's http range reads
and the shard cache need: `serving(directory)` yields its base URL and stops it afterwards."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import threading
from collections.abc import Iterator


class RangeFiles(http.server.SimpleHTTPRequestHandler):
    """Static files; a ``Range: bytes=a-b`` request gets a 206 with exactly those bytes."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def end_headers(self):
        self.send_header("Accept-Ranges", "bytes")
        super().end_headers()

    def do_GET(self):
        rng = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not rng or not os.path.isfile(path):
            return super().do_GET()
        size = os.path.getsize(path)
        a, b = rng.split("=")[1].split("-")
        start, stop = int(a), min(size, int(b) + 1 if b else size)
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(stop - start)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def serving(directory) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` serving ``directory`` (Range reads included) until the block ends."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeFiles, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
