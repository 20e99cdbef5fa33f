"""Checking many TFRecord frames at once: the one checker every reader uses.

A batch of records is given by their ``(offset, framed length)`` index entries. Their 12-byte
headers (length + its masked CRC) and 4-byte footers (the payload's masked CRC) are gathered into
small matrices and compared with numpy for the whole batch; each payload CRC is one C ``crc32c``
call. The result is a mask of bad records; `first_error` re-checks one of them record by record
(`crossfeed.format.tfrecord.unframe`) for an error that names the file, the byte offset and the
reason. `crossfeed.read.stages.frames` (the Loader's frame stage) and `crossfeed.read.tools.verify` are
built on these functions.
"""

from __future__ import annotations

import functools
import struct

import crc32c as _crc32c
import numpy as np

from crossfeed.errors import CorruptRecordError
from crossfeed.format import tfrecord
from crossfeed.format.tfrecord import FOOTER, HEADER, crc32c_rows, mask

FRAMING = HEADER + FOOTER  # bytes of a framed record that are not payload


def gather(u8: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """``(n, width)`` matrix of ``u8[s : s + width]`` for each start (a copy)."""
    return u8[starts[:, None] + np.arange(width)]


def window(u8: np.ndarray, width: int) -> np.ndarray:
    """Row ``k`` is ``u8[k : k + width]`` (a read-only strided view: no copy)."""
    return np.lib.stride_tricks.as_strided(u8, (len(u8) - width + 1, width), (1, 1), writeable=False)


def out_of_bounds(offsets: np.ndarray, lengths: np.ndarray, size: int) -> np.ndarray:
    """Index entries that cannot hold a framed record inside a stream of ``size`` bytes."""
    return (offsets < 0) | (offsets + lengths > size) | (lengths < FRAMING)


@functools.lru_cache(maxsize=64)
def _len_crcs(lo: int, hi: int) -> np.ndarray:
    """The masked CRC of the length header of framed records of ``lo..hi`` bytes."""
    return np.array([tfrecord.masked_crc(struct.pack("<Q", n - FRAMING)) for n in range(lo, hi + 1)], dtype=np.uint32)


def bad_headers(head: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Which ``(n, ≥12)`` headers disagree with their framed ``lengths`` (from the index) or
    fail their length CRC. ``lengths`` must all be ``>= FRAMING`` (see `out_of_bounds`)."""
    stored_len = head[:, :8].copy().view("<u8").ravel()
    stored_crc = head[:, 8:12].copy().view("<u4").ravel()
    bad = stored_len != (lengths - FRAMING).astype(np.uint64)
    lo, hi = int(lengths.min()), int(lengths.max())
    if hi - lo <= 64:  # the usual case: the CRC of a length is a table lookup
        bad |= _len_crcs(lo, hi)[lengths - lo] != stored_crc
    else:
        bad |= mask(crc32c_rows(head[:, :8])) != stored_crc
    return bad


def bad_payloads(payloads, stored: np.ndarray) -> np.ndarray:
    """Which payloads (buffers) do not match their stored masked CRC32C (one C call each)."""
    crcs = np.fromiter(map(_crc32c.crc32c, payloads), dtype=np.uint32, count=len(payloads))
    return mask(crcs) != stored


def bad_payload_rows(payload: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """`bad_payloads` for payloads given as the rows of a ``(g, length)`` uint8 matrix: one C call
    per row, on ``bytes`` made in one C loop (a void view's ``tolist``)."""
    rows = payload.view(f"V{payload.shape[1]}")[:, 0].tolist() if payload.shape[1] else [b""] * len(payload)
    return bad_payloads(rows, stored)


def stored_crcs(u8: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The masked payload CRCs stored in the footers of the records at ``offsets``."""
    return gather(u8, offsets + lengths - FOOTER, FOOTER).view("<u4").ravel()


def payload_views(buf, offsets: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
    """Zero-copy payload views (map over C callables: no Python bytecode runs per record)."""
    return list(
        map(memoryview(buf).__getitem__, map(slice, (offsets + HEADER).tolist(), (offsets + lengths - FOOTER).tolist()))
    )


def first_error(buf, offset: int, length: int, path: str) -> CorruptRecordError:
    """The precise error of a record that failed a batch check."""
    size = len(memoryview(buf))
    if offset < 0 or offset + length > size or length < FRAMING:
        return CorruptRecordError(
            path, offset, f"index entry of {length} bytes runs past the end of the data ({size} bytes)"
        )
    try:
        tfrecord.unframe(buf, offset, length, path)
    except CorruptRecordError as e:
        return e
    return CorruptRecordError(path, offset, "record failed its checks")


def check_frames(buf, offsets: np.ndarray, lengths: np.ndarray, path: str) -> list[memoryview]:
    """Payload views of the records at ``offsets`` of one in-memory stream (mmap or bytes),
    every header and payload CRC checked; raises `CorruptRecordError` for the first bad one."""
    u8 = np.frombuffer(buf, dtype=np.uint8)
    bad = out_of_bounds(offsets, lengths, len(u8))
    if not bad.any() and len(offsets):
        bad = bad_headers(gather(u8, offsets, HEADER), lengths)
        if not bad.any():
            payloads = payload_views(buf, offsets, lengths)
            bad = bad_payloads(payloads, stored_crcs(u8, offsets, lengths))
            if not bad.any():
                return payloads
    if not len(offsets):
        return []
    i = int(np.argmax(bad))
    raise first_error(buf, int(offsets[i]), int(lengths[i]), path)
