"""Checking a dataset against its manifest: every record's CRCs, every index entry, record counts,
byte sizes and sha256 of every shard, that each record decodes per the schema, and each lengths
file's size and sha256 (`crossfeed.format.lengths`, where the manifest lists lengths).

``verify_dataset(path)`` is what ``crossfeed verify`` runs, on a local or a remote dataset (each
remote shard downloaded once into a temporary file, then checked as a local one). It keeps going after a problem, so one
run lists every bad shard; a problem that stops a shard's scan (a bad record) still leaves the
other shards checked. For GZIP shards offsets are positions in the uncompressed stream.

It runs at about read speed in bounded memory: each shard is read once, in chunks of
`CHUNK_BYTES`, hashed as it is read, its frames checked a chunk at a time (`check_frames`) and
each chunk decoded by the Loader's own decoder.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from crossfeed.errors import (
    ConfigError,
    CorruptRecordError,
    DatasetNotFoundError,
    ExampleError,
    IndexFileError,
    SchemaError,
    redact,
)
from crossfeed.format import example as ex
from crossfeed.format import index as idx
from crossfeed.format import tfrecord
from crossfeed.format.frames import check_frames
from crossfeed.format.lengths import DTYPE as LENGTHS_DTYPE
from crossfeed.format.lengths import checked_lengths, lengths_path
from crossfeed.format.manifest import ShardInfo
from crossfeed.format.parquet import column_maps
from crossfeed.format.schema import Schema, decode_value
from crossfeed.io.files import file_sha256, map_file
from crossfeed.io.storage import Storage, retrying
from crossfeed.read.sources.dataset import INDEX_BYTES_PER_RECORD, open_dataset
from crossfeed.read.sources.parquet import check_file
from crossfeed.read.stages.decode import RecordDecoder, make_decoder
from crossfeed.read.stages.frames import Frames
from crossfeed.read.tools.problem import Problem
from crossfeed.read.tools.verify_tar import verify_tar_shard

CHUNK_BYTES = 8 << 20  # bytes of records checked at once: memory stays bounded by a few chunks


def verify_dataset(
    path,
    split: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    *,
    allowed_roots=(),
    storage_options: Mapping | None = None,
) -> list[Problem]:
    """All problems of the dataset at ``path`` (one split, or all); an empty list when it is sound.
    ``progress(done_bytes, total_bytes)`` is called as the shards' bytes are checked;
    ``allowed_roots`` and ``storage_options`` as `crossfeed.open_dataset` takes them. A remote
    dataset's shards are downloaded one at a time, each once, into a temporary directory
    (``$TMPDIR``: room for the largest shard) and checked there as a local one is."""
    with open_dataset(path, allowed_roots=allowed_roots, storage_options=storage_options) as ds:
        if split is not None and split not in ds.splits:
            raise ConfigError(f"{ds.path}: no split {split!r}; it has {sorted(ds.splits)}")
        shards = [sh for name in ([split] if split is not None else sorted(ds.splits)) for sh in ds.splits[name].shards]
        total = sum(sh.num_bytes for sh in shards)
        decoder = make_decoder(ds.schema, decode_images=False, recycle=0)
        problems: list[Problem] = []
        done = 0
        formats = {sh.file: s.format for s in ds.splits.values() for sh in s.shards}
        remote = ds.storage.remote or ds.index_storage.remote
        for shard in shards:
            report = (
                None if progress is None else (lambda n, base=done: progress(base + min(n, shard.num_bytes), total))
            )
            with (
                _fetched(ds, shard, formats[shard.file]) if remote else _as_is(ds) as (
                    storage,
                    index_storage,
                    urls,
                    refused,
                )
            ):
                if refused is not None:  # it could not be fetched as the manifest declares it
                    found = [refused]
                elif (
                    formats[shard.file] == "tar"
                ):  # WebDataset tar shards: header checksums, sha256, the index, the schema
                    found = verify_tar_shard(storage, shard, ds.schema, progress=report, index_storage=index_storage)
                else:
                    found = verify_shard(
                        storage,
                        shard,
                        ds.schema,
                        decoder=decoder,
                        progress=report,
                        index_storage=index_storage,
                        shard_format=formats[shard.file],
                        parquet_maps=column_maps(ds.manifest.metadata),
                    )
                problems += [_renamed(p, urls) for p in found]
            if shard.lengths_sha256 is not None:
                bad = _check_lengths(ds.index_storage, shard, len(ds.manifest.lengths))
                if not bad and not any(shard.file in p.file for p in found):
                    bad = _cross_check_lengths(ds, shard)  # the file is the one pinned: does it tell the truth?
                problems += bad
            done += shard.num_bytes
            if progress is not None:
                progress(done, total)
        return problems


def _cross_check_lengths(ds, shard: ShardInfo, most: int = 20) -> list[Problem]:
    """Each record's count of values of each lengths feature against its lengths file: a lengths
    file pinned by the manifest may still lie (written by a buggy tool, or re-pinned), and packing
    trusts it to place every token (a record said to hold 0 tokens is never read)."""
    split, k = next(
        (ds[name], i) for name in sorted(ds.splits) for i, sh in enumerate(ds[name].shards) if sh.file == shard.file
    )
    names = list(ds.manifest.lengths)
    where = ds.index_storage.url(lengths_path(shard.file))
    data = ds.index_storage.read(lengths_path(shard.file), limit=shard.num_records * len(names) * 4)
    table = checked_lengths(data, where, shard, len(names))
    out: list[Problem] = []
    for r in range(shard.num_records):
        values = split.decode(k, r, features=names, decode_images=False)
        for j, name in enumerate(names):
            have = int(np.size(values[name]))
            if have != int(table[r, j]):
                out.append(
                    Problem(
                        where,
                        None,
                        f"record {r} of {shard.file} holds {have} values of {name!r}, its lengths file says "
                        f"{int(table[r, j])}; rebuild the lengths (`crossfeed index --force --lengths {name}`)",
                    )
                )
                if len(out) >= most:
                    out.append(
                        Problem(where, None, f"more records of {shard.file} disagree with it (stopped at {most})")
                    )
                    return out
    return out


def _check_lengths(storage: Storage, shard: ShardInfo, features: int) -> list[Problem]:
    """What is wrong with a shard's lengths file: missing, or not the size and sha256 the manifest pins."""
    name = lengths_path(shard.file)
    where = storage.url(name)
    fix = "rebuild the lengths (convert again, or `crossfeed index --force --lengths FEATURE`)"
    limit = shard.num_records * features * LENGTHS_DTYPE.itemsize

    def too_long(n: int) -> Exception:
        return IndexFileError(f"{where}: {n} bytes or more, expected {limit}; {fix}")

    try:
        data = retrying(lambda: storage.read(name, limit=limit, too_long=too_long), where, what="the lengths file")
        checked_lengths(data, where, shard, features)
    except DatasetNotFoundError:
        return [Problem(where, None, f"lengths file is missing; {fix}")]
    except IndexFileError as e:
        return [Problem(where, None, str(e).removeprefix(f"{redact(where)}: "))]
    return []


@contextlib.contextmanager
def _as_is(ds):
    yield ds.storage, ds.index_storage, {}, None


@contextlib.contextmanager
def _fetched(ds, shard: ShardInfo, shard_format: str):
    """``(storage, index storage, {local path: URL}, None)`` of one shard of a remote dataset (and its
    index, where remote) downloaded once into a temporary directory; a missing remote file is left
    missing there. A shard longer than the manifest says is not fetched past its size: the
    last item is then the `Problem` that says so (nothing else of it is checked)."""
    with tempfile.TemporaryDirectory(prefix="crossfeed-verify-") as tmp:
        local = Storage(tmp)
        urls = {local.url(shard.file): ds.storage.url(shard.file)}
        refused = None
        if ds.storage.remote:
            fd = os.open(local.url(shard.file), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                retrying(
                    lambda: ds.storage.download_into(shard.file, fd, shard.num_bytes),
                    ds.storage.url(shard.file),
                    what="the shard",
                )
            except DatasetNotFoundError:
                os.unlink(local.url(shard.file))
            except CorruptRecordError as e:  # longer than the manifest says: the rest is not fetched
                refused = Problem(
                    ds.storage.url(shard.file), None, f"{e.reason}; the file changed after it was written"
                )
            finally:
                os.close(fd)
            if refused is not None:
                yield None, None, urls, refused
                return
        index_storage = ds.index_storage
        if shard_format != "parquet" and ds.index_storage.remote:
            name = idx.index_path(shard.file)
            urls[local.url(name)] = ds.index_storage.url(name)
            limit = INDEX_BYTES_PER_RECORD * (shard.num_records + 1)
            try:
                data = retrying(
                    lambda: ds.index_storage.read(name, limit=limit), urls[local.url(name)], what="the index"
                )
            except DatasetNotFoundError:
                data = None
            if data is not None:
                with open(local.url(name), "wb") as f:
                    f.write(data)
            index_storage = local
        yield (local if ds.storage.remote else ds.storage), index_storage, urls, None


def _renamed(p: Problem, urls: dict) -> Problem:
    """``p`` naming the remote files, not their temporary copies."""
    if not urls:
        return p
    file, reason = urls.get(p.file, p.file), p.reason
    for path, url in urls.items():
        reason = reason.replace(path, url)
    return Problem(file, p.offset, reason)


def verify_shard(
    storage: Storage,
    shard: ShardInfo,
    schema: Schema,
    *,
    decoder: RecordDecoder | None = None,
    progress: Callable[[int], None] | None = None,
    index_storage: Storage | None = None,
    shard_format: str = "tfrecord",
    parquet_maps: dict | None = None,
) -> list[Problem]:
    """The problems of one shard and its index (in ``index_storage``, default beside the shard);
    a Parquet shard (``shard_format``) has no index: its footer, pages and sha256 are checked.
    ``progress(bytes_read)`` follows the file; ``parquet_maps``: how Parquet columns are read
    (`crossfeed.format.parquet.column_maps`).

    Fast path, for a shard whose index tiles it (the usual case): one sequential pass reads the
    file in chunks, hashes it, checks each chunk's frames with `check_frames` and decodes it with
    the Loader's own decoder (`make_decoder`). Anything wrong sends the shard down the slow path, which walks
    the records on its own and compares them with the index, to say exactly what is wrong."""
    path = storage.url(shard.file)
    ipath = (index_storage or storage).url(idx.index_path(shard.file))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return [
            Problem(
                path, None, "shard file is missing; restore it, or re-index what is left with `crossfeed index --force`"
            )
        ]
    if not stat.S_ISREG(st.st_mode):  # a FIFO or device would hang or never end
        return [Problem(path, None, "not a regular file (a directory, FIFO or device); a shard is a plain file")]
    problems = []
    if st.st_size != shard.num_bytes:
        problems.append(Problem(path, None, f"file is {st.st_size} bytes, the manifest says {shard.num_bytes}"))
    if shard_format == "parquet":  # no index file: the footer, every page and the sha256
        if file_sha256(path) != shard.sha256:
            problems.append(
                Problem(path, None, "sha256 differs from the manifest: the file changed after it was indexed")
            )
        problems += [Problem(path, off, why) for off, why in check_file(path, shard, schema, parquet_maps)]
        if progress is not None:
            progress(shard.num_bytes)
        return problems
    gz = tfrecord.is_gzip(path)
    entries, index_problems = _load_index(ipath, shard, None if gz else st.st_size)
    if entries is not None and not index_problems.structural:
        fast = _fast(path, gz, entries, decoder or make_decoder(schema, decode_images=False, recycle=0), progress)
        if fast is not None:
            sha, record_problems = fast
            if sha != shard.sha256:
                problems.append(
                    Problem(path, None, "sha256 differs from the manifest: the file changed after it was written")
                )
            return problems + record_problems + index_problems.problems
    # slow path: the index does not tile the shard, or a record is damaged
    if file_sha256(path) != shard.sha256:
        problems.append(Problem(path, None, "sha256 differs from the manifest: the file changed after it was written"))
    scanned, stream_len, complete = _scan(path, schema, problems)
    if complete and len(scanned) != shard.num_records:
        problems.append(Problem(path, None, f"holds {len(scanned)} records, the manifest says {shard.num_records}"))
    found = [] if entries is None else _check_index(ipath, entries, scanned, stream_len, shard.num_records)
    return problems + (found or index_problems.problems)


@dataclass
class _IndexProblems:
    problems: list[Problem]
    structural: bool  # the entries cannot be trusted to tile the shard


def _load_index(ipath: str, shard: ShardInfo, size: int | None) -> tuple[np.ndarray | None, _IndexProblems]:
    """The index entries and what is wrong with the index file (`idx.checked_index`'s checks)."""
    try:
        st = os.stat(ipath)
        if not stat.S_ISREG(st.st_mode):
            return None, _IndexProblems(
                [Problem(ipath, None, "not a regular file; rebuild it with `crossfeed index --force`")], True
            )
        with open(ipath, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None, _IndexProblems(
            [Problem(ipath, None, "index file is missing; rebuild it with `crossfeed index --force`")], True
        )
    try:
        entries = idx.parse_index(data, ipath)
    except IndexFileError as e:
        return None, _IndexProblems([Problem(ipath, None, str(e).removeprefix(f"{redact(ipath)}: "))], True)
    problems = []
    if len(entries) != shard.num_records:
        problems.append(Problem(ipath, None, f"{len(entries)} entries, the manifest says {shard.num_records} records"))
    if shard.index_sha256 is not None and hashlib.sha256(data).hexdigest() != shard.index_sha256:
        problems.append(
            Problem(
                ipath,
                None,
                "sha256 differs from the manifest's index_sha256: the index changed after it "
                "was written; rebuild it with `crossfeed index --force`",
            )
        )
    ends = entries[:, 0] + entries[:, 1]
    tiles = (
        not len(entries)
        or (entries[0, 0] == 0 and bool(np.all(entries[1:, 0] == ends[:-1])) and (size is None or ends[-1] == size))
    ) and (len(entries) or not size)
    return entries, _IndexProblems(problems, not tiles)


def _fast(
    path: str, gz: bool, entries: np.ndarray, decoder: RecordDecoder, progress: Callable[[int], None] | None
) -> tuple[str, list[Problem]] | None:
    """``(sha256, decode problems)`` from one chunked pass, or None if a frame, the GZIP stream or
    the stream's length disagrees with the index (then the slow path says what is wrong)."""
    problems: list[Problem] = []
    offsets, lengths = entries[:, 0], entries[:, 1]
    ends = offsets + lengths
    try:
        with _Stream(path, gz) as stream:
            a = 0
            while a < len(entries):
                b = max(a + 1, int(np.searchsorted(ends, offsets[a] + CHUNK_BYTES, side="right")))
                base = int(offsets[a])
                buf = stream.take(int(ends[b - 1]) - base)
                if len(buf) != int(ends[b - 1]) - base:
                    return None  # the stream ends before the index does
                payloads = check_frames(buf, offsets[a:b] - base, lengths[a:b], path)
                if not problems:
                    bad = _decode_check(decoder, payloads)
                    if bad is not None:
                        problems.append(Problem(path, int(offsets[a + bad[0]]), bad[1]))
                del payloads
                a = b
                if progress is not None:
                    progress(stream.raw_bytes)
            if stream.rest():
                return None  # records (or junk) after the last indexed one
            return stream.sha256(), problems
    except CorruptRecordError:
        return None


def _decode_check(decoder: RecordDecoder, payloads: list) -> tuple[int, str] | None:
    """The first payload that does not decode per the schema, ``(position, reason)``; the batch
    decoder checks the chunk at once, the reference decoder finds which record is bad."""
    if not payloads:
        return None
    try:
        decoder(Frames(np.arange(len(payloads)), payloads=payloads))
        return None
    except (ExampleError, SchemaError):
        pass
    for i, p in enumerate(payloads):
        reason = _decode_problem(decoder.features, p)
        if reason:
            return i, reason
    return 0, "records do not match the schema"  # the batch decoder saw what the reference did not


class _Stream:
    """A shard file read front to back once: hashed as it is read, inflated if GZIP (by
    `crossfeed.format.tfrecord.inflate`, one chunk at a time); ``take(n)`` gives the next ``n``
    bytes of the record stream."""

    BLOCK = 4 << 20

    def __init__(self, path: str, gz: bool):
        self._f = open(path, "rb")
        self._hash = hashlib.sha256()
        self._chunks = tfrecord.inflate(self._read, path) if gz else None
        self._out = bytearray()  # inflated, not yet taken
        self.raw_bytes = 0

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def _read(self, n: int) -> bytes:
        data = self._f.read(n)
        self._hash.update(data)
        self.raw_bytes += len(data)
        return data

    def take(self, n: int):
        if self._chunks is None:
            return self._read(n)
        while len(self._out) < n and (chunk := next(self._chunks, None)) is not None:
            self._out += chunk
        out = bytes(self._out[:n])
        del self._out[:n]
        return out

    def rest(self) -> bool:
        """Read the file to its end (for the hash); whether stream bytes were left after what was
        taken (one more inflated chunk tells: the rest is not inflated)."""
        left = bool(self._out) or (self._chunks is not None and next(self._chunks, None) is not None)
        self._out.clear()
        while self._read(self.BLOCK):
            pass
        return left

    def sha256(self) -> str:
        return self._hash.hexdigest()


def _scan(path: str, schema: Schema, problems: list[Problem]) -> tuple[np.ndarray, int, bool]:
    """Walk the shard's records; returns ``(offsets_and_lengths, stream_length, reached_the_end)``.
    A GZIP shard is inflated as it is walked, never whole (no index it could be bounded by is
    trusted here); after a bad record the rest is inflated only to count its length."""
    found: list[tuple[int, int]] = []
    bad_sample = False
    seen = [0]  # uncompressed bytes inflated so far

    def counted(chunks):
        for chunk in chunks:
            seen[0] += len(chunk)
            yield chunk

    with contextlib.ExitStack() as stack:
        chunks = None
        records: Iterator[tuple[int, bytes | memoryview]] | None = None
        payload: bytes | memoryview | None = None
        try:
            if tfrecord.is_gzip(path):
                chunks = tfrecord.inflate(stack.enter_context(open(path, "rb")).read, path)
                records = tfrecord.stream_records(counted(chunks), path)
            else:
                buf = stack.enter_context(map_file(path))
                seen[0] = len(buf)
                records = tfrecord.records(buf, path)
            for offset, payload in records:
                found.append((offset, tfrecord.HEADER + len(payload) + tfrecord.FOOTER))
                if not bad_sample:
                    reason = _decode_problem(schema, payload)
                    if reason:
                        bad_sample = True
                        problems.append(Problem(path, offset, reason))
            payload = None  # release the view before the mmap closes
            complete = True
        except CorruptRecordError as e:
            problems.append(Problem(path, e.offset, e.reason))
            complete = False
            payload = records = None
            with contextlib.suppress(CorruptRecordError):  # the stream's length, past the bad record
                for chunk in chunks or ():
                    seen[0] += len(chunk)
    return np.array(found, dtype=np.int64).reshape(-1, 2), seen[0], complete


def _decode_problem(schema, payload) -> str | None:
    try:
        parsed = ex.decode(payload)
        for f in schema:
            decode_value(f, parsed, decode_images=False)
    except (ExampleError, SchemaError) as e:
        return f"record does not match the schema: {e}"
    return None


def _check_index(ipath: str, entries: np.ndarray, scanned: np.ndarray, stream_len: int, expected: int) -> list[Problem]:
    """The index entries compared with the records a scan found."""
    problems = []
    if len(entries) != expected:
        problems.append(Problem(ipath, None, f"{len(entries)} entries, the manifest says {expected} records"))
    past = np.flatnonzero(entries.sum(axis=1) > stream_len)
    if past.size:
        o, n = entries[past[0]]
        problems.append(
            Problem(
                ipath,
                int(o),
                f"entry {past[0]} ({o} {n}) points past the end of the shard "
                f"({stream_len} bytes){_more(past.size)}; rebuild it with `crossfeed index --force`",
            )
        )
    k = min(len(entries), len(scanned))
    wrong = np.flatnonzero(np.any(entries[:k] != scanned[:k], axis=1))
    wrong = np.setdiff1d(wrong, past)
    if wrong.size:
        i = int(wrong[0])
        problems.append(
            Problem(
                ipath,
                int(entries[i][0]),
                f"entry {i} says '{entries[i][0]} {entries[i][1]}', the record "
                f"there is '{scanned[i][0]} {scanned[i][1]}'{_more(wrong.size)}; "
                f"rebuild it with `crossfeed index --force`",
            )
        )
    return problems


def _more(n: int) -> str:
    return f" (and {n - 1} more such entries)" if n > 1 else ""
