"""TFRecord framing: the on-disk record format of TensorFlow, read and written without it.

A record is ``uint64 length | uint32 masked_crc32c(length) | payload | uint32 masked_crc32c(payload)``,
all little-endian. Every read checks both CRCs (C-accelerated ``crc32c``); a failure raises
`CorruptRecordError` naming the file and byte offset. GZIP files are the same stream, compressed
whole (what ``tf.io.TFRecordOptions(compression_type="GZIP")`` writes).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
from collections.abc import Iterator
from typing import BinaryIO

import crc32c as _crc32c

from crossfeed.errors import CorruptRecordError

HEADER = 12  # uint64 length + uint32 crc of the length
FOOTER = 4  # uint32 crc of the payload
_MASK_DELTA = 0xA282EAD8
_LEN = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<QI")


def masked_crc(data) -> int:
    """The masked CRC32C that TFRecord stores (TensorFlow's ``crc32c::Mask``)."""
    crc = _crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(payload: bytes) -> bytes:
    """One framed record, ready to append to a shard."""
    length = _LEN.pack(len(payload))
    return b"".join((length, _U32.pack(masked_crc(length)), payload, _U32.pack(masked_crc(payload))))


def is_gzip(path: str | os.PathLike) -> bool:
    return str(path).endswith(".gz")


def unframe(buf, offset: int, length: int | None, path: str) -> memoryview:
    """Check the record framed at ``buf[offset:]`` and return a view of its payload.

    ``length`` is the framed length from an index (header + payload + footer), or None when the
    caller does not know it. Raises `CorruptRecordError` naming ``path`` and ``offset``.
    """
    mv = memoryview(buf)
    end = len(mv)
    if offset < 0 or offset + HEADER > end:
        raise CorruptRecordError(path, offset, f"record header runs past the end of the data ({end} bytes)")
    n, len_crc = _HEAD.unpack_from(mv, offset)
    if masked_crc(mv[offset : offset + 8]) != len_crc:
        raise CorruptRecordError(path, offset, "length CRC mismatch (not a TFRecord file, or a damaged header)")
    if length is not None and HEADER + n + FOOTER != length:
        raise CorruptRecordError(path, offset, f"index says {length} bytes, the record header says {HEADER + n + FOOTER}")
    start = offset + HEADER
    stop = start + n
    if stop + FOOTER > end:
        raise CorruptRecordError(path, offset, f"truncated: the record needs {n + HEADER + FOOTER} bytes, {end - offset} remain")
    payload = mv[start:stop]
    if masked_crc(payload) != _U32.unpack_from(mv, stop)[0]:
        raise CorruptRecordError(path, offset, "payload CRC mismatch (damaged data)")
    return payload


def scan(buf, path: str) -> Iterator[tuple[int, int]]:
    """Walk a whole (uncompressed) TFRecord stream; yields ``(offset, framed_length)`` per record,
    checking every CRC."""
    offset, end = 0, len(buf)
    while offset < end:
        payload = unframe(buf, offset, None, path)
        length = HEADER + len(payload) + FOOTER
        yield offset, length
        offset += length


def read_bytes(path: str | os.PathLike) -> bytes:
    """The uncompressed stream of a shard file (GZIP shards are inflated)."""
    if is_gzip(path):
        try:
            with gzip.open(path, "rb") as f:
                return f.read()
        except (OSError, EOFError) as e:
            raise CorruptRecordError(str(path), 0, f"not a readable GZIP stream ({e})") from e
    with open(path, "rb") as f:
        return f.read()


class _HashingFile:
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class RecordWriter:
    """Appends framed records to one shard file and remembers each record's ``(offset, length)``
    in the uncompressed stream, for the index file."""

    def __init__(self, path: str | os.PathLike, *, compress: bool = False):
        self.path = str(path)
        raw = _HashingFile(open(self.path, "wb"))
        self._raw = raw
        # mtime=0 keeps GZIP output byte-identical from run to run.
        self._f: BinaryIO = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) if compress else raw
        self.offsets: list[tuple[int, int]] = []
        self._pos = 0

    def write(self, payload: bytes) -> None:
        rec = frame(payload)
        self._f.write(rec)
        self.offsets.append((self._pos, len(rec)))
        self._pos += len(rec)

    @property
    def num_bytes(self) -> int:
        """Bytes written to the file (compressed size for GZIP); final after `close`."""
        return self._raw.size

    @property
    def sha256(self) -> str:
        """Hex sha256 of the file's bytes; final after `close`."""
        return self._raw.hash.hexdigest()

    def close(self) -> None:
        if self._f is not self._raw:
            self._f.close()
        self._raw.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
