"""Local files as readers see them: a file's bytes mapped as stored, and a file's sha256 read in
chunks. Used by `verify` and by adoption (GZIP streams are inflated by
`crossfeed.format.tfrecord.inflate`, bounded or record by record)."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
from collections.abc import Iterator


@contextlib.contextmanager
def map_file(path: str) -> Iterator:
    """A local file's bytes as stored: a read-only mmap (``b""`` for an empty file)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield mm
    finally:
        with contextlib.suppress(BufferError):  # a caller still holds a view; it goes with them
            mm.close()


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
