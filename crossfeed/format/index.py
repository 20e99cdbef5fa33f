"""Index files: one ``offset length`` line per record, the format of the ``tfrecord`` package's
``tfrecord2idx`` and of DALI. ``length`` is the framed length (header + payload + footer).
For GZIP shards the offsets are positions in the uncompressed stream.

An index is trusted only once checked (`checked_index`): against the manifest's ``index_sha256``
where it has one, and always for tiling its shard, so that no edited entry can make a reader
return one record twice and another never. Indexes of fixed-width lines (what crossfeed writes)
can also be read lazily (`LazyIndex`): entries parsed where a batch needs them, each block of
entries checked for tiling the first time it is touched — opening a split is O(shards)."""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
import warnings
from collections.abc import Callable

import numpy as np

from crossfeed.errors import IndexFileError


def index_path(shard_path: str | os.PathLike) -> str:
    """The index file that sits beside a shard: ``train-00000-of-00004.tfrecord`` → ``….idx``."""
    return str(shard_path) + ".idx"


FIXED_MIN = 1024  # indexes of at least this many entries are written with lines of one width


def format_index(offsets) -> bytes:
    """The index file's bytes. An index of `FIXED_MIN` entries or more has lines of one width
    (numbers padded with leading zeros, which every reader of the format accepts): entry ``k`` is
    at byte ``k × width``, so a reader can take the entries a batch needs without reading the
    file (`LazyIndex`); a smaller one is written as ``tfrecord2idx`` writes it."""
    offsets = list(offsets)
    if len(offsets) < FIXED_MIN:
        return "".join(f"{o} {n}\n" for o, n in offsets).encode()
    arr = np.array(offsets, dtype=np.int64).reshape(-1, 2)
    if arr.min() < 0:  # not an index crossfeed writes: as the format reads, number by number
        wo = len(str(max(o for o, _ in offsets)))
        wn = len(str(max(n for _, n in offsets)))
        return "".join(f"{o:0{wo}d} {n:0{wn}d}\n" for o, n in offsets).encode()
    # the lines' characters as a (records, width) matrix: each number's digits, zero-padded
    wo, wn = len(str(int(arr[:, 0].max()))), len(str(int(arr[:, 1].max())))
    out = np.empty((len(arr), wo + wn + 2), dtype=np.uint8)
    out[:, :wo] = _digits(arr[:, 0], wo)
    out[:, wo] = ord(" ")
    out[:, wo + 1 : -1] = _digits(arr[:, 1], wn)
    out[:, -1] = ord("\n")
    return out.tobytes()


def _digits(values: np.ndarray, width: int) -> np.ndarray:
    """The ASCII decimal digits of non-negative ``values``, zero-padded to ``width``: ``(n, width)``."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return (values[:, None] // powers % 10 + ord("0")).astype(np.uint8)


def write_index(path: str | os.PathLike, offsets, *, sync: bool = True) -> str:
    """Write an index file (fsynced, unless ``sync`` is False: the caller fsyncs it) and return
    its sha256, for the manifest."""
    data = format_index(offsets)
    with open(path, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def parse_index(data: bytes, path: str) -> np.ndarray:
    """Parse an index file's bytes into an ``(n, 2)`` int64 array of ``(offset, length)``.

    Well-formed files (digits, one space, newline) are parsed in one C pass (~6× faster: the
    index of a large shard is parsed when a batch first touches it); anything else takes the
    careful path, whose errors say what is wrong."""
    data = bytes(data)
    if data and not data.translate(None, b"0123456789 \n") and data.endswith(b"\n"):
        lines = data.count(b"\n")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            flat = np.fromstring(data.decode("ascii"), dtype=np.int64, sep=" ")
        if len(flat) == 2 * lines and data.count(b" ") == lines and len(data) < 40 * lines:
            arr = flat.reshape(-1, 2)
            if arr.min() >= 0 and not np.any(arr[:, 1] < 16) and arr.max() <= 1 << 56:
                return arr
    text = data.decode("ascii", errors="replace")
    fields = text.split()
    if len(fields) % 2:
        raise IndexFileError(f"{path}: odd number of fields; expected 'offset length' per line")
    try:
        arr = np.array(fields, dtype=np.int64).reshape(-1, 2)
    except (ValueError, OverflowError) as e:
        raise IndexFileError(
            f"{path}: not an index file of 'offset length' lines ({e}); rebuild it with `crossfeed index`"
        ) from e
    if len(arr) and (arr.min() < 0 or np.any(arr[:, 1] < 16) or arr.max() > 1 << 56):
        raise IndexFileError(
            f"{path}: negative offset or a record shorter than 16 bytes; rebuild it with `crossfeed index`"
        )
    return arr


def read_index(path: str | os.PathLike) -> np.ndarray:
    try:
        with open(path, "rb") as f:
            return parse_index(f.read(), str(path))
    except FileNotFoundError as e:
        raise IndexFileError(f"{path}: index file is missing; rebuild it with `crossfeed index`") from e


def checked_index(data: bytes, where: str, shard, *, gzip: Callable[[], bool]) -> np.ndarray:
    """Parse the index of ``shard`` (a `crossfeed.format.manifest.ShardInfo`) and check it.

    With the manifest's ``index_sha256`` the bytes must match it. Whatever the manifest holds
    (older ones have no checksum) the entries must tile the record stream: the first at offset 0,
    each starting where the one before ends, the last ending at the file's size for a plain
    shard (``gzip()`` says whether it is compressed; only asked when the end differs). So an
    entry edited to point at another record is caught before any record is read.
    Raises `IndexFileError` naming the index file and the entry.
    """
    fix = "rebuild it with `crossfeed index --force`"
    arr = parse_index(data, where)
    if len(arr) != shard.num_records:
        raise IndexFileError(
            f"{where}: {len(arr)} entries, the manifest says {shard.num_records} records; the "
            f"dataset is inconsistent, {fix}"
        )
    if len(arr):
        _check_tiling(arr, where, shard.num_bytes, gzip, fix)
    if shard.index_sha256 is not None and hashlib.sha256(data).hexdigest() != shard.index_sha256:
        raise IndexFileError(
            f"{where}: sha256 differs from the manifest's index_sha256: the index changed after it was written; {fix}"
        )
    return arr


def _check_tiling(arr: np.ndarray, where: str, num_bytes: int, gzip: Callable[[], bool], fix: str) -> None:
    if arr[0, 0] != 0:
        raise IndexFileError(f"{where}: entry 0 starts at byte {arr[0, 0]}, not 0; {fix}")
    ends = arr[:, 0] + arr[:, 1]
    gaps = np.flatnonzero(arr[1:, 0] != ends[:-1])
    if gaps.size:
        k = int(gaps[0]) + 1
        raise IndexFileError(
            f"{where}: entry {k} ('{arr[k, 0]} {arr[k, 1]}') does not start where entry {k - 1} "
            f"ends (byte {ends[k - 1]}); {fix}"
        )
    if ends[-1] != num_bytes and not gzip():
        raise IndexFileError(
            f"{where}: the last entry (entry {len(arr) - 1}) ends at byte {ends[-1]}, the shard is "
            f"{num_bytes} bytes; {fix}"
        )


BLOCK = 1 << 10  # a `LazyIndex` checks its entries this many at a time


class LazyIndex:
    """An index file of fixed-width lines (`format_index`) read in place by positioned reads
    (``read(offset, size) → bytes``; not an mmap, whose faults may map megabytes of page cache
    around each line): ``index[k]`` (an int64 array ``k``) → ``(len(k), 2)`` ``(offset, length)``, parsed from those
    lines only. The checks of `checked_index` are kept, but lazily: at opening, the entry count
    and the first and last entries (O(1)); the first time an entry is read, its block of `BLOCK`
    entries — that each is a well-formed line, starts where the one before ends (the block's last
    ends where the next block starts) and that the block lies after the blocks checked before it
    and before those after it. So no two entries ever read make records overlap, or leave bytes
    out between them. (The file's sha256 is checked where the whole index is read: small splits,
    `crossfeed verify`.) `open` returns None where the lines are not of one width.
    """

    def __init__(self, read, where: str, num_records: int, num_bytes: int | None, width: int, space: int):
        self.where, self.n, self._read = where, int(num_records), read
        self._space, self._width = space, width
        # a line minus `_zero` is its digits (≤ 9) and zeros at the space and newline (≤ `_most`);
        # its digits times `_powers` are the entry (in float64, exact below 2**53, where it can)
        self._zero = np.full(width, 48, dtype=np.uint8)
        self._zero[space], self._zero[-1] = 32, 10
        self._most = np.full(width, 9, dtype=np.uint8)
        self._most[space] = self._most[-1] = 0
        exact = space <= 15 and width - space - 2 <= 15
        self._powers = np.zeros((width, 2), dtype=np.float64 if exact else np.int64)
        self._powers[:space, 0] = 10 ** np.arange(space - 1, -1, -1, dtype=np.int64)
        self._powers[space + 1 : width - 1, 1] = 10 ** np.arange(width - space - 3, -1, -1, dtype=np.int64)
        blocks = (self.n + BLOCK - 1) // BLOCK
        self._checked = np.zeros(blocks, dtype=bool)
        self._span: dict[int, tuple[int, int]] = {}  # checked block → (its first start, its last end)
        self._done: list[int] = []  # the checked blocks, in order
        self._all_checked = False
        self._lock = threading.Lock()
        first = self._parse(self._lines(0, 1), 0)[0]
        if first[0] != 0:
            raise IndexFileError(f"{where}: entry 0 starts at byte {first[0]}, not 0; {_FIX}")
        last = self._parse(self._lines(self.n - 1, self.n), self.n - 1)[0]
        self.end = int(last[0] + last[1])
        if num_bytes is not None and self.end != num_bytes:
            raise IndexFileError(
                f"{where}: the last entry (entry {self.n - 1}) ends at byte {self.end}, the shard is "
                f"{num_bytes} bytes; {_FIX}"
            )

    @classmethod
    def open(cls, read, size: int, where: str, num_records: int, num_bytes: int | None) -> LazyIndex | None:
        """The lazy form of the index file of ``size`` bytes that ``read(offset, size)`` reads,
        or None where its lines are not of one width (then it is read whole, `checked_index`).
        ``num_bytes``: the stream's size (None: unknown, a GZIP shard)."""
        if not num_records or not size:
            return None
        head = read(0, 64)
        width = head.find(b"\n") + 1
        space = head.find(b" ")
        if width < 4 or not 0 < space < width - 2 or size != width * num_records:
            return None
        return cls(read, where, num_records, num_bytes, width, space)

    def _lines(self, lo: int, hi: int) -> np.ndarray:
        """Lines ``lo`` to ``hi`` as a ``(hi - lo, width)`` uint8 matrix (one read)."""
        w = self._width
        data = self._read(lo * w, (hi - lo) * w)
        if len(data) != (hi - lo) * w:
            raise IndexFileError(f"{self.where}: the file ends before entry {hi - 1}; {_FIX}")
        return np.frombuffer(data, dtype=np.uint8).reshape(hi - lo, w)

    def _parse(self, rows: np.ndarray, first: int | None = None) -> np.ndarray:
        """``rows`` (lines of the file) as ``(offset, length)``; with ``first`` (the entry
        number of the first row) each line is checked to be well formed."""
        d = rows - self._zero
        if first is not None:
            self._check_lines(d, lambda j: first + j)
        return (d.astype(self._powers.dtype) @ self._powers).astype(np.int64)

    def _check_lines(self, d: np.ndarray, entry) -> None:
        if (d > self._most).any():
            j = int(np.flatnonzero((d > self._most).any(axis=1))[0])
            raise IndexFileError(
                f"{self.where}: entry {entry(j)} is not an 'offset length' line {self._width} bytes long like "
                f"the first; {_FIX}"
            )

    def _check_blocks(self, blocks: list[int]) -> None:
        """Check these blocks (sorted, unchecked) in one pass: each read with the next block's first
        entry, the lines well formed, each tiling, and each between its checked neighbours."""
        w = self._width
        spans = [(b * BLOCK, min((b + 1) * BLOCK + 1, self.n)) for b in blocks]
        data = b"".join([self._read(lo * w, (hi - lo) * w) for lo, hi in spans])
        sizes = np.array([hi - lo for lo, hi in spans], dtype=np.int64)
        if len(data) != int(sizes.sum()) * w:
            raise IndexFileError(f"{self.where}: the file is shorter than its entries; {_FIX}")
        seg = np.concatenate([[0], np.cumsum(sizes)])
        entry = np.repeat(np.array([lo for lo, _ in spans], dtype=np.int64) - seg[:-1], sizes) + np.arange(seg[-1])
        d = np.frombuffer(data, dtype=np.uint8).reshape(-1, w) - self._zero
        self._check_lines(d, lambda j: int(entry[j]))
        arr = (d.astype(self._powers.dtype) @ self._powers).astype(np.int64)
        short = np.flatnonzero(arr[:, 1] < 16)
        if short.size:
            raise IndexFileError(f"{self.where}: entry {int(entry[short[0]])} is shorter than 16 bytes; {_FIX}")
        ends = arr[:, 0] + arr[:, 1]
        gap = arr[1:, 0] != ends[:-1]
        gap[seg[1:-1] - 1] = False  # a block's lines and the next read block's are not neighbours
        if gap.any():
            k = int(entry[int(np.flatnonzero(gap)[0]) + 1])
            raise IndexFileError(f"{self.where}: entry {k} does not start where entry {k - 1} ends; {_FIX}")
        starts = arr[seg[:-1], 0]
        last = np.minimum(seg[:-1] + BLOCK, seg[1:]) - 1  # each block's own last entry
        with self._lock:
            done, span = self._done, self._span
            for b, start, end in zip(blocks, starts.tolist(), ends[last].tolist()):
                at = bisect.bisect_left(done, b)
                below = done[at - 1] if at else None
                above = done[at] if at < len(done) else None
                # blocks of BLOCK entries of ≥ 16 bytes each lie between this one and its checked neighbours
                if (
                    (below is not None and start < span[below][1] + 16 * BLOCK * (b - 1 - below))
                    or (above is not None and end + 16 * BLOCK * (above - b - 1) > span[above][0])
                    or end > self.end
                ):
                    raise IndexFileError(
                        f"{self.where}: entries {b * BLOCK}–{min((b + 1) * BLOCK, self.n) - 1} overlap the "
                        f"entries before or after them; {_FIX}"
                    )
                span[b] = (start, end)
                done.insert(at, b)
                self._checked[b] = True

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k) -> np.ndarray:
        k = np.asarray(k, dtype=np.int64)
        if not self._all_checked:
            blocks = k // BLOCK
            todo = blocks[~self._checked[blocks]]
            if todo.size:
                self._check_blocks(np.unique(todo).tolist())
                self._all_checked = len(self._done) == len(self._checked)
        w, read = self._width, self._read
        if len(k) <= SMALL_READ:  # a few entries (a batch spread over many shards): no numpy per entry
            lines = [read(x * w, w) for x in k.tolist()]  # one positioned read per entry
            if any(len(x) != w for x in lines):
                raise IndexFileError(f"{self.where}: the file is shorter than its entries; {_FIX}")
            sp = self._space  # checked lines: digits, one space, a newline
            return np.array([(int(x[:sp]), int(x[sp + 1 : w - 1])) for x in lines], dtype=np.int64).reshape(-1, 2)
        data = b"".join([read(x * w, w) for x in k.tolist()])
        if len(data) != len(k) * w:
            raise IndexFileError(f"{self.where}: the file is shorter than its entries; {_FIX}")
        return self._parse(np.frombuffer(data, dtype=np.uint8).reshape(len(k), w))


SMALL_READ = 16  # up to this many entries are parsed one by one


_FIX = "rebuild it with `crossfeed index --force`"
