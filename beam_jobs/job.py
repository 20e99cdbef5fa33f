"""``convert(source, out, ...)``: read a source and write a dataset with one Beam pipeline, on the
offline in-process runner unless told otherwise (runner.py); what ``crossfeed convert`` runs
(its command line is the one front end: ``crossfeed convert csv data.csv out/ --runner DaskRunner``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from crossfeed.beam_jobs.commit import remove_temporaries
from crossfeed.beam_jobs.runner import in_process, run_pipeline
from crossfeed.beam_jobs.sources import ReadSource, Source
from crossfeed.beam_jobs.splits import SplitSpec
from crossfeed.beam_jobs.write import WriteDataset
from crossfeed.errors import ConfigError
from crossfeed.write.commit import check_target, read_manifest
from crossfeed.write.options import WriteOptions
from crossfeed.write.target import write_target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConvertResult:
    path: str
    samples: dict[str, int]
    shards: dict[str, int]
    num_bytes: int
    seconds: float
    skipped: int
    dropped: dict[str, int] = field(default_factory=dict)  # records left out on purpose, by reason
    narrowed: dict[str, str] = field(default_factory=dict)  # columns stored narrower than read, and how

    @property
    def total_samples(self) -> int:
        return sum(self.samples.values())

    @property
    def samples_per_second(self) -> float:
        return self.total_samples / self.seconds if self.seconds > 0 else float("inf")


def _memory_staging() -> int:
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        physical = 8 << 30
    return min(1 << 30, physical // 8)


# Bytes of encoded batches a job on the in-process runner keeps in memory until its shard writers
# copy them, rather than staging them in files (`WriteDataset(stage_in_memory=)`); past it, on
# disk. 1 GiB, or an eighth of the machine's memory if that is less.
MEMORY_STAGING = _memory_staging()


def convert(
    source: Source,
    out,
    *,
    split: str = "train",
    splits: SplitSpec | str | None = None,
    seed: int = 0,
    runner: str | None = None,
    beam_args: Sequence[str] = (),
    on_progress: Callable[[int, int, float], None] | None = None,
    overwrite: bool = False,
    options: WriteOptions | None = None,
    storage_options: Mapping | None = None,
    append: bool = False,
    **fields,
) -> ConvertResult:
    """Convert ``source`` into split(s) of the dataset at ``out``; returns what was written.

    How it is laid out is one `WriteOptions` (``options=``, or its fields as keywords:
    ``num_shards``, ``shard_size="64MB"``, ``compress``, ``max_skips`` — the job-wide budget of
    bad records; the source's own ``on_error=ErrorPolicy.of(options)`` says whether it skips).
    ``on_progress(samples, bytes, seconds)`` is called about twice a second while the job runs
    (samples encoded so far; works on any runner whose workers share ``out``'s filesystem). On
    failure the job's temporary files are removed and the error propagates. ``out`` must be new or
    empty; ``overwrite=True`` replaces the dataset there, all of it, in one atomic commit;
    ``append=True`` adds the converted shards to the dataset there as its next version (the old
    version kept and readable as ``out@vN``; the schema must be the dataset's, a difference names
    the feature: `crossfeed.write.commit.commit_splits`).

    ``out`` is a local directory or any fsspec URL the read side reads (``s3://bucket/dir`` with
    ``storage_options={"endpoint_url": …}``, ``gs://``, ``memory://``): the job writes into a
    local staging directory and the dataset is published there, manifest last
    (`crossfeed.write.target`; the workers must reach the staging directory, as they reach a local
    ``out``). A URL of an unknown scheme is refused, never written as a local folder.
    """
    options = WriteOptions.given(options, fields, who="convert")
    with write_target(out, storage_options=storage_options, overwrite=overwrite) as target:
        if append and target.remote:
            raise ConfigError(f"{target.url}: --append writes to a local directory; append there, then upload it")
        with _held(source, runner, beam_args) as held:
            result = _convert(
                held, target.root, split, splits, seed, runner, beam_args, on_progress, overwrite, options, append
            )
    return dataclasses.replace(result, path=target.url if target.remote else result.path)


def _held(source, runner, beam_args):
    """``source`` with what it holds (a text source's tokenizer) kept in this process's memory
    for the job, where every step runs in this process; else ``source`` as it is."""
    if hasattr(source, "held") and in_process(runner, beam_args):
        return source.held()
    return contextlib.nullcontext(source)


def _convert(
    source, out, split, splits, seed, runner, beam_args, on_progress, overwrite, options, append=False
) -> ConvertResult:
    old = check_target(out, overwrite=overwrite, clean=True, append=append)  # refuse before any work
    lengths = getattr(source, "length_features", ())
    if append and old and not lengths:
        lengths = tuple(old.lengths)  # the dataset's lengths files, for the appended shards too
    token = secrets.token_hex(6)
    write = WriteDataset(
        out,
        split=split,
        splits=splits,
        schema=source.schema,
        metadata=source.metadata,
        seed=seed,
        batched=True,
        token=token,
        progress=on_progress is not None,
        overwrite=overwrite,
        lengths=lengths,
        options=options,
        append=append,
        stage_in_memory=MEMORY_STAGING if in_process(runner, beam_args) else 0,
    )
    read = ReadSource(source)
    watcher = _Watcher(write.cfg.progress_dir, on_progress) if on_progress is not None else None
    start = time.perf_counter()
    try:
        run_pipeline(
            lambda p: p | "Read" >> read | "Write" >> write,
            runner=runner,
            beam_args=beam_args,
            work_units=read.num_units,
        )
    except BaseException:
        remove_temporaries(out, token=token)
        raise
    finally:
        if watcher is not None:
            watcher.stop()
    seconds = time.perf_counter() - start
    manifest = read_manifest(out)
    if manifest is None:
        raise ConfigError(f"{out}: the pipeline finished but wrote no manifest; was the runner's job cancelled?")
    names = write.cfg.splits.names
    kept = old.splits if append and old else {}  # appended: what this job added, not the whole split
    new = {n: manifest.splits[n].shards[len(kept[n].shards) if n in kept else 0 :] for n in names}
    return ConvertResult(
        out,
        {n: sum(s.num_records for s in new[n]) for n in names},
        {n: len(new[n]) for n in names},
        sum(s.num_bytes for n in names for s in new[n]),
        seconds,
        int(manifest.metadata.get("skipped_records", 0)),
        dict(manifest.metadata.get("dropped_records", {})),
        dict(manifest.metadata.get("narrowed", {})),
    )


class _Watcher:
    """Adds up the progress files the Encode step leaves and reports them until stopped."""

    def __init__(self, folder: str, callback: Callable[[int, int, float], None], interval: float = 0.5):
        self.folder, self.callback, self.interval = folder, callback, interval
        self._stop = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="crossfeed-convert-progress", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.callback(*self.totals(), time.perf_counter() - self._start)

    def totals(self) -> tuple[int, int]:
        samples = nbytes = 0
        try:
            names = [n for n in os.listdir(self.folder) if not n.startswith(".")]
        except OSError:
            return 0, 0
        for name in names:
            try:
                with open(os.path.join(self.folder, name)) as f:
                    a, b = f.read().split()
                samples, nbytes = samples + int(a), nbytes + int(b)
            except (OSError, ValueError):
                continue
        return samples, nbytes

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def make_source(kind: str, src, **options) -> Source:
    """The source for ``kind`` (images, csv, parquet, numpy, text) with its options."""
    if kind == "images":
        from crossfeed.beam_jobs.images import ImageFolderSource

        return ImageFolderSource.scan(src, **options)
    if kind == "csv":
        from crossfeed.beam_jobs.csv_source import CsvSource

        return CsvSource.scan(src, **options)
    if kind == "parquet":
        from crossfeed.beam_jobs.parquet_source import ParquetSource

        return ParquetSource.scan(src, **options)
    if kind == "numpy":
        from crossfeed.beam_jobs.arrays import NumpySource

        return NumpySource.scan(src, **options)
    if kind == "text":
        from crossfeed.beam_jobs.text_source import TextSource

        return TextSource.scan(src, **options)
    raise ConfigError(f"unknown source kind {kind!r}; use images, csv, parquet, numpy or text")
