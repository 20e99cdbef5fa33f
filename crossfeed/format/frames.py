"""Frame checks for a whole batch at once: the TFRecord length headers, their CRCs and the stored
payload CRCs of many records are gathered from an in-memory stream (mmap or bytes) and compared
with numpy; only the payload CRC is one C ``crc32c`` call per record. A failure is re-checked
record by record (`crossfeed.format.tfrecord.unframe`) so the error names the exact file and offset."""

from __future__ import annotations

import functools
import struct

import numpy as np

import crc32c as _crc32c

from crossfeed.format import tfrecord
from crossfeed.errors import CorruptRecordError

_MASK_DELTA = np.uint32(0xA282EAD8)


def _table() -> np.ndarray:
    poly = 0x82F63B78
    t = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        t[i] = c
    return t


_TABLE = _table()


def crc32c_rows(rows: np.ndarray) -> np.ndarray:
    """CRC32C of each row of a small ``(n, k)`` uint8 array, vectorised over rows."""
    crc = np.full(len(rows), 0xFFFFFFFF, dtype=np.uint32)
    for j in range(rows.shape[1]):
        crc = _TABLE[(crc ^ rows[:, j]) & 0xFF] ^ (crc >> np.uint32(8))
    return crc ^ np.uint32(0xFFFFFFFF)


def mask(crc: np.ndarray) -> np.ndarray:
    crc = crc.astype(np.uint32)
    return ((crc >> np.uint32(15)) | (crc << np.uint32(17))) + _MASK_DELTA


def gather(u8: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    return u8[starts[:, None] + np.arange(width)]


def check_frames(buf, offsets: np.ndarray, lengths: np.ndarray, path: str, *, payload_crcs: bool = True) -> list[memoryview]:
    """Payload views of the records at ``offsets`` of an in-memory stream, every CRC checked.

    Raises `CorruptRecordError` for the first bad record (by position in ``offsets``). With
    ``payload_crcs=False`` only the headers (lengths and their CRCs) are checked here: the
    caller checks the payloads itself with `frame_crcs` and `crc_ok` (`crossfeed.read.profile` does,
    to time reading and CRC checking apart).
    """
    u8 = np.frombuffer(buf, dtype=np.uint8)
    size = len(u8)
    bad_range = (offsets < 0) | (offsets + lengths > size) | (lengths < tfrecord.HEADER + tfrecord.FOOTER)
    if bad_range.any():
        i = int(np.argmax(bad_range))
        raise CorruptRecordError(path, int(offsets[i]), f"index entry of {int(lengths[i])} bytes runs past the end of the file ({size} bytes)")
    head = gather(u8, offsets, 12)
    n = head[:, :8].copy().view("<u8").ravel()
    stored_len_crc = head[:, 8:12].copy().view("<u4").ravel()
    bad = mask(crc32c_rows(head[:, :8])) != stored_len_crc
    bad |= n + tfrecord.HEADER + tfrecord.FOOTER != lengths.astype(np.uint64)
    if bad.any():
        return _first_error(buf, offsets, lengths, path, bad)
    # map over C callables: no Python bytecode runs per record
    payloads = list(map(memoryview(buf).__getitem__, map(slice, (offsets + tfrecord.HEADER).tolist(),
                                                          (offsets + lengths - tfrecord.FOOTER).tolist())))
    if payload_crcs:
        bad = ~crc_ok(payloads, frame_crcs(u8, offsets, lengths))
        if bad.any():
            return _first_error(buf, offsets, lengths, path, bad)
    return payloads


def frame_crcs(u8: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The masked payload CRCs stored in the footers of the records at ``offsets``."""
    return gather(u8, offsets + lengths - 4, 4).view("<u4").ravel()


def crc_ok(payloads, stored: np.ndarray) -> np.ndarray:
    """Which payloads match their stored masked CRC32C (one C call per payload)."""
    crcs = np.fromiter(map(_crc32c.crc32c, payloads), dtype=np.uint32, count=len(payloads))
    return mask(crcs) == stored


def window(u8: np.ndarray, width: int) -> np.ndarray:
    """Row ``k`` is ``u8[k : k + width]`` (a read-only strided view: no copy)."""
    return np.lib.stride_tricks.as_strided(u8, (len(u8) - width + 1, width), (1, 1), writeable=False)


@functools.lru_cache(maxsize=64)
def len_crcs(lo: int, hi: int) -> np.ndarray:
    """The masked CRC of the length header of framed records of ``lo..hi`` bytes."""
    return np.array([tfrecord.masked_crc(struct.pack("<Q", n - tfrecord.HEADER - tfrecord.FOOTER)) for n in range(lo, hi + 1)],
                    dtype=np.uint32)


def _first_error(buf, offsets, lengths, path, bad) -> list:
    i = int(np.argmax(bad))
    tfrecord.unframe(buf, int(offsets[i]), int(lengths[i]), path)  # raises with the precise reason
    raise CorruptRecordError(path, int(offsets[i]), "record failed its checks")
