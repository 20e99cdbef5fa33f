"""Hugging Face ``datasets`` folders, recognised by their file names so that they are named as
what they are instead of failing as TFRecord shards: what `save_to_disk` writes (a `Dataset`:
``data-SSSSS-of-NNNNN.arrow`` Arrow IPC stream files with ``dataset_info.json`` and
``state.json``; a `DatasetDict`: ``dataset_dict.json`` and a folder per split) and the cache's
Arrow files (``<name>-<split>.arrow`` beside ``dataset_info.json``).

Their Arrow IPC files are adopted and read in place as Parquet files are (``crossfeed index``:
`ArrowFile` gives the Parquet reader and adoption each record batch as a row group, memory-mapped);
a folder that is not indexed yet is named with what to run (`advice`).
"""

from __future__ import annotations

from collections.abc import Iterable

from crossfeed.errors import CrossfeedError

DATASET_DICT = "dataset_dict.json"
STATE = "state.json"
INFO = "dataset_info.json"


def kind(names: Iterable[str]) -> str | None:
    """``"dataset_dict"``, ``"dataset"`` (a `save_to_disk` folder), ``"arrow"`` (Arrow files
    beside a ``dataset_info.json``: the cache's), or None, from a folder's file names."""
    names = set(names)
    if DATASET_DICT in names:
        return "dataset_dict"
    arrow = any(n.endswith(".arrow") for n in names)
    if arrow and STATE in names:
        return "dataset"
    if arrow and INFO in names:
        return "arrow"
    return None


def advice(root: str, found: str) -> str:
    """One message: what ``root`` is and how to make crossfeed read it."""
    if found == "dataset_dict":
        return (
            f"{root}: a Hugging Face `datasets` DatasetDict saved with save_to_disk (a folder per split); index "
            f"each split's folder and read it in place: `crossfeed index {root}/<split>` (add --index-dir OUT to "
            f"leave it untouched); docs/adopt.md"
        )
    what = "saved with save_to_disk" if found == "dataset" else "cache folder"
    return (
        f"{root}: a Hugging Face `datasets` {what} (Arrow IPC files) that is not indexed yet; run "
        f"`crossfeed index {root}` to read it in place (add --index-dir OUT to leave the folder untouched); "
        f"docs/adopt.md"
    )


def is_arrow_name(name: str) -> bool:
    """Whether a file name is an Arrow IPC file (``*.arrow``: what ``datasets`` writes)."""
    return not name.startswith(".") and name.lower().endswith(".arrow")


class _Chunk:
    """What the Parquet reader asks of a column chunk: where its pages start (an Arrow IPC file
    has no pages: errors point at the file's start)."""

    dictionary_page_offset = None
    data_page_offset = 0


class _Group:
    def __init__(self, batch):
        self.num_rows = batch.num_rows
        self.total_byte_size = batch.nbytes

    def column(self, j: int) -> _Chunk:
        return _Chunk()


class _Metadata:
    def __init__(self, batches):
        self._groups = [_Group(b) for b in batches]
        self.num_row_groups = len(batches)
        self.num_rows = sum(g.num_rows for g in self._groups)

    def row_group(self, r: int) -> _Group:
        return self._groups[r]


class ArrowFile:
    """An Arrow IPC file — the stream format ``datasets`` writes (``save_to_disk``, its cache), or
    the file format — as the part of ``pyarrow.parquet.ParquetFile`` the Parquet reader and
    adoption use: each record batch is a row group. ``source``: a local path (memory-mapped: the
    batches are views of the file's pages, nothing is copied) or the file's bytes. Raises
    ``pyarrow.ArrowInvalid`` (an ArrowException) when it is not an Arrow IPC file."""

    def __init__(self, source):
        from crossfeed.format.parquet import pyarrow_modules

        pa, _ = pyarrow_modules()
        self._pa = pa
        self._buf = pa.memory_map(source, "r") if isinstance(source, str) else pa.BufferReader(source)
        try:
            try:
                reader = pa.ipc.open_stream(self._buf)
                batches = list(reader)
            except pa.ArrowInvalid:
                self._buf.seek(0)
                reader = pa.ipc.open_file(self._buf)
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except BaseException:
            self._buf.close()
            raise
        self.schema_arrow = reader.schema
        self._batches = batches
        self.metadata = _Metadata(batches)

    def _table(self, r: int, columns):
        t = self._pa.Table.from_batches([self._batches[r]], schema=self.schema_arrow)
        return t.select(list(columns)) if columns is not None else t

    def read_row_group(self, r: int, columns=None, use_threads: bool = True):
        return self._table(r, columns)

    def iter_batches(self, batch_size: int, row_groups, columns=None, use_threads: bool = True):
        for r in row_groups:
            yield from self._table(r, columns).to_batches(max_chunksize=batch_size)

    def close(self) -> None:
        self._batches = []
        self._buf.close()

    def __enter__(self) -> ArrowFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_columnar(source, path: str):
    """``path``'s Parquet file (``pyarrow.parquet.ParquetFile``, page CRCs checked) or, for an
    ``*.arrow`` name, its `ArrowFile`; ``source`` is what to open (the path, a file object or
    the bytes)."""
    from crossfeed.format.parquet import pyarrow_modules

    pa, pq = pyarrow_modules()
    if is_arrow_name(path.rsplit("/", 1)[-1]):
        if not isinstance(source, str) and hasattr(source, "read"):
            source = source.read()
        return ArrowFile(source)
    return pq.ParquetFile(source, page_checksum_verification=True)


def arrow_splits(names, place, default: str) -> dict[str, str]:
    """The split of each Arrow file of a folder: a `save_to_disk` folder's ``data-SSSSS-of-NNNNN``
    files are one split (``default``); the cache's ``<builder>-<split>[-SSSSS-of-NNNNN].arrow``
    name theirs (the builder from ``dataset_info.json``, else the first ``-``-separated word)."""
    import json
    import re

    builder = None
    try:
        info = json.loads(place.read(INFO, 1 << 20))
        builder = info.get("builder_name") or info.get("dataset_name")
    except (CrossfeedError, OSError, ValueError, AttributeError):  # no or unreadable info: names alone
        builder = None
    out = {}
    for n in names:
        stem = re.sub(r"-\d{5}-of-\d{5}$", "", n[: -len(".arrow")])
        if re.fullmatch(r"data", stem):
            out[n] = default
        elif builder and stem.startswith(builder + "-"):
            out[n] = stem[len(builder) + 1 :]
        else:
            out[n] = stem.split("-", 1)[1] if "-" in stem else default
    return out
