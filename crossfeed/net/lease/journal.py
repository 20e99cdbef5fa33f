"""The dispatcher's journal: checksummed JSON lines, appended and fsync'ed before the change is answered.

A line is `<crc> <record>\\n`: the record one JSON object, `<crc>` the masked CRC32C of its bytes
(`crossfeed.format.tfrecord.masked_crc`, TFRecord's) as 8 lowercase hex digits. The first line
is the plan (`{"t": "plan", "batches": ..., "epochs": ..., **plan fields}`); the lines after it
are `LeaseBook` records. `Journal(path, plan=...).read()` trusts nothing it finds:

* every complete line (one that ends in a newline) must match its checksum, parse strictly (one
  JSON object: no duplicate key, no NaN) and, checked by `Replay`, hold the fields of its kind
  with integer values in range (batch numbers below the plan's `batches` — below the epoch's
  own count when the plan's count changes with the epoch (packed rows) —, epochs up to its
  `epochs`, 64-bit ids) and follow from the records before it (a batch is done only after it
  was claimed in its epoch, an epoch ends only once each of its batches is done, a claim quotes
  a lease id the journal reserved). The first line that does not raises `JournalError` naming
  the file, the line and its byte offset: the dispatcher stops rather than guess which batches
  a damaged record made used or claimed;
* only the last line may lack its newline: an append cut short by a crash. An append is
  answered only after it returned and was fsync'ed, so what it left unfinished was never
  answered, and dropping that line is safe (and logged). A last line whose record is intact
  (only its newline is missing, or the newline itself is damaged) is kept: it may have been
  answered.

`append(records)` writes and fsyncs (the dispatcher appends each loop pass's records at once: one
write and one fsync per pass, a group commit); `compact(records)` replaces the file with the plan and the
given records, written to `<name>.tmp` created afresh (`O_EXCL | O_NOFOLLOW`: never through a
planted link; a leftover regular file of an interrupted compaction is removed first, anything
else there is refused), fsync'ed, renamed over the journal, the directory fsync'ed. The journal
is opened with `O_NOFOLLOW`: one that is a symbolic link is refused, never followed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from crossfeed.errors import ConfigError, JournalError
from crossfeed.format.tfrecord import masked_crc

logger = logging.getLogger(__name__)

MAX_LINE = 1 << 20  # bytes; a record is a few dozen, the plan a few hundred
_HEX = re.compile(rb"[0-9a-f]{8}")
_ID_END = 1 << 64  # trainer ids: non-zero u64
_TOKEN_END = 1 << 63  # claim tokens travel in an i64 slot
_EPOCH_END = 1 << 62  # epochs without end (`epochs` None)
_FIX = (
    "The dispatcher cannot know which batches that record made used or claimed. Put back a good "
    "copy of the journal, or move it away to start the plan afresh (the epoch in progress then "
    "starts over: batches already used are served again)"
)

# each record kind and its fields (besides "t"), all integers
FIELDS: dict[str, tuple[str, ...]] = {
    "epoch": ("epoch",),
    "unclaim": ("trainer", "epoch"),
    "claim": ("trainer", "epoch", "b", "token"),  # token: the batch's claim token (0: used, see snapshot)
    "done": ("epoch", "b"),
}
_CLAIMED, _DONE = 2, 3  # as `book.CLAIMED`, `book.DONE`


def encode(record: dict[str, Any]) -> bytes:
    """One journal line: the checksum, a space, the record's JSON, a newline."""
    body = json.dumps(record, separators=(",", ":"), allow_nan=False).encode()
    return b"%08x %s\n" % (masked_crc(body), body)


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key appears twice")
    return out


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a value a journal holds")


def decode(line: bytes) -> dict[str, Any]:
    """The record of one line (without its newline); ValueError says why it is not one."""
    if len(line) > MAX_LINE:
        raise ValueError(f"{len(line)} bytes, more than a record can have ({MAX_LINE})")
    if len(line) < 10 or line[8:9] != b" " or not _HEX.fullmatch(line[:8]):
        raise ValueError("no checksum (8 lowercase hex digits and a space) at its start")
    body = line[9:]
    if masked_crc(body) != int(line[:8], 16):
        raise ValueError("its checksum does not match its bytes")
    try:
        record = json.loads(body, object_pairs_hook=_pairs, parse_constant=_constant)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON ({e})") from e
    if not isinstance(record, dict) or not isinstance(record.get("t"), str):
        raise ValueError("not a JSON object with a string 't'")
    return record


def _canonical(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


class Replay:
    """Checks each `LeaseBook` record against the plan and the records before it (see the
    module docstring); `check(record)` returns why one is refused, or None."""

    def __init__(self, batches: int, epochs: int | None, counts: Callable[[int], int] | None = None):
        self.batches, self.epochs, self._counts = batches, epochs, counts
        self.epoch, self.first = 0, True
        self.n = batches  # batches of `self.epoch`
        self.state: dict[int, tuple[int, int]] = {}  # batch -> (CLAIMED or DONE, trainer)
        self.done = 0

    def check(self, r: dict[str, Any]) -> str | None:
        kind = r["t"]
        names = FIELDS.get(kind)
        if names is None:
            return f"unknown record kind {kind!r}"
        if set(r) != {"t", *names}:
            return f"a {kind!r} record has the fields {sorted(names)}, this one {sorted(set(r) - {'t'})}"
        for name in names:
            if type(r[name]) is not int:
                return f"{name} is {r[name]!r}, not an integer"
        first, self.first = self.first, False
        if first and kind != "epoch":
            return f"the records start with a {kind!r} record, not the epoch"
        last = self.epochs if self.epochs is not None else _EPOCH_END
        epoch = r.get("epoch", 0)
        if not (-1 if kind == "unclaim" else 0) <= epoch <= last:
            return f"epoch {epoch} is outside 0..{last}"
        if "b" in r and not 0 <= r["b"] < self.n:  # an epoch may have no batch (every step skipped)
            return f"batch {r['b']} is outside 0..{self.n - 1}"
        if not 0 < r.get("trainer", 1) < _ID_END:
            return f"trainer id {r['trainer']} is not a non-zero 64-bit id"
        finished = self.epochs is not None and self.epoch >= self.epochs
        if kind == "epoch":
            if first:  # a compacted journal starts with the epoch it was in
                self.epoch = epoch
            elif epoch != self.epoch + 1 or self.done != self.n:
                return f"epoch {epoch} follows epoch {self.epoch} with {self.done} of {self.n} batches done"
            self.epoch, self.state, self.done = epoch, {}, 0
            if self._counts is not None and not (self.epochs is not None and epoch >= self.epochs):
                self.n = self._counts(epoch)
        elif kind == "unclaim":
            if epoch not in (-1, self.epoch):
                return f"an unclaim of epoch {epoch} in epoch {self.epoch}"
            if epoch == self.epoch:
                for b in [b for b, (s, t) in self.state.items() if s == _CLAIMED and t == r["trainer"]]:
                    del self.state[b]
        elif epoch != self.epoch or finished:
            return f"a {kind!r} record of epoch {epoch} in epoch {self.epoch}{' (finished)' if finished else ''}"
        elif kind == "claim":
            if r["b"] in self.state:
                return f"batch {r['b']} claimed again without being given back"
            if not 0 <= r["token"] < _TOKEN_END:
                return f"claim token {r['token']} is not a 63-bit token"
            self.state[r["b"]] = (_CLAIMED, r["trainer"])
        else:  # done
            s = self.state.get(r["b"])
            if s is None or s[0] != _CLAIMED:
                return f"batch {r['b']} done without being claimed"
            self.state[r["b"]] = (_DONE, s[1])
            self.done += 1
        return None


class Journal:
    """`read()` the records of a previous run, `append` new ones, `compact` to a snapshot."""

    def __init__(
        self,
        path: str | os.PathLike | None,
        *,
        plan: dict[str, Any] | None = None,
        compact_after: int = 10_000,
        counts: Callable[[int], int] | None = None,
    ):
        self.path = Path(path) if path is not None else None  # None: no journal (nothing kept)
        self.plan = plan
        self.counts = counts  # epoch -> its batches, when they change with the epoch (see `Replay`)  # None: no plan line (the bare record file of the book's own tests)
        self.compact_after = compact_after
        self._lines = 0
        self._compacted = 0  # lines the last compaction left
        self.syncs = 0  # appends written and fsync'ed (one per dispatcher loop pass that changed the book)
        self._file: BinaryIO | None = None  # opened at the first append

    def _error(self, line: int, offset: int, reason: str) -> JournalError:
        return JournalError(f"journal {self.path} line {line} (byte {offset}): {reason}. {_FIX}")

    def _read_bytes(self) -> bytes | None:
        assert self.path is not None  # `read` asks only when there is a journal
        try:  # O_NONBLOCK: a FIFO planted there must not block the open (and the dispatcher) forever
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            if os.path.islink(self.path):
                raise JournalError(
                    f"journal {self.path} is a symbolic link; the dispatcher never follows one: pass "
                    "the real path as --journal"
                ) from e
            raise
        with os.fdopen(fd, "rb") as f:
            self._check_regular(f.fileno())
            os.set_blocking(f.fileno(), True)
            return f.read()

    def _check_regular(self, fd: int) -> None:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a file"
            raise JournalError(
                f"journal {self.path} is not a regular file ({kind}); the dispatcher reads and appends only a "
                "regular file: remove it, or pass another path as --journal"
            )

    def read(self) -> list[dict[str, Any]]:
        """The records after the plan line (every record when there is no plan), each checked;
        [] when there is no journal yet."""
        if self.path is None:
            return []
        data = self._read_bytes()
        if not data:
            return []
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline
        records: list[tuple[int, dict[str, Any]]] = []  # (byte offset, record)
        offset = 0
        for i, line in enumerate(lines):
            try:
                records.append((offset, decode(line)))
            except ValueError as e:
                raise self._error(i + 1, offset, str(e)) from e
            offset += len(line) + 1
        if tail:
            for candidate in (tail, tail[:-1]):  # complete but for its newline; its newline damaged
                try:
                    records.append((offset, decode(candidate)))
                except ValueError:
                    continue
                logger.warning("journal %s: the last line has no newline; its record is intact and kept", self.path)
                break
            else:
                logger.warning(
                    "journal %s: ignoring the unfinished last line (%d bytes at byte %d): an append cut "
                    "short by a crash, never answered",
                    self.path,
                    len(tail),
                    offset,
                )
        self._lines = len(records)
        if self.plan is None or not records:  # not records: a lone unfinished line, never answered
            return [r for _, r in records]
        if _canonical(records[0][1]) != _canonical(self.plan):
            theirs, mine = records[0][1].get("identity"), self.plan.get("identity")
            what = (
                f"another stream (identity {str(theirs)[:32]!r}; this dispatcher's is {mine!r}: another dataset, "
                "version or settings)"
                if theirs != mine
                else f"another plan ({records[0][1]}, this one is {self.plan})"
            )
            raise ConfigError(
                f"journal {self.path} belongs to {what}: pass another --journal, or --restart to start "
                "this plan afresh on it"
            )
        replay = Replay(self.plan["batches"], self.plan["epochs"], self.counts)
        for i, (at, record) in enumerate(records[1:], start=2):
            reason = replay.check(record)
            if reason is not None:
                raise self._error(i, at, reason)
        return [r for _, r in records[1:]]

    def append(self, records: list[dict[str, Any]]) -> None:
        if not records or self.path is None:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except OSError as e:  # a FIFO nobody reads (ENXIO), a link (ELOOP), a directory
                raise JournalError(f"cannot append to journal {self.path}: {e.strerror or e}") from e
            try:
                self._check_regular(fd)
                os.set_blocking(fd, True)
            except BaseException:
                os.close(fd)
                raise
            self._file = os.fdopen(fd, "ab")
        self._file.write(b"".join(encode(r) for r in records))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._lines += len(records)
        self.syncs += 1

    def due(self) -> bool:
        """Time to compact: `compact_after` lines, and twice as many as the last compaction left
        (a snapshot of a long epoch holds a record or two per batch used: compacting whenever it
        is over `compact_after` would rewrite the whole file on every append)."""
        return self.path is not None and self._lines >= max(self.compact_after, 2 * self._compacted)

    def compact(self, snapshot: list[dict[str, Any]]) -> None:
        """Replace the journal with the plan line and `snapshot` (see the module docstring)."""
        if self.path is None:
            return
        records = snapshot if self.plan is None else [self.plan, *snapshot]
        tmp = self.path.with_name(self.path.name + ".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            st = os.lstat(tmp)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISREG(st.st_mode):
                raise JournalError(
                    f"{tmp} is in the way of compacting the journal and is not a regular file (a "
                    "symbolic link?); the dispatcher never writes through one: remove it"
                )
            os.unlink(tmp)  # left by a compaction a crash interrupted
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError as e:
            raise JournalError(f"{tmp} appeared while compacting the journal: is another dispatcher using it?") from e
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(encode(r) for r in records))
            f.flush()
            os.fsync(f.fileno())
        if self._file is not None:
            self._file.close()
            self._file = None
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._lines = self._compacted = len(records)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
