"""``convert(source, out, ...)``: read a source and write a dataset with one Beam pipeline, on the
offline in-process runner unless told otherwise (runner.py); what ``crossfeed convert`` runs.

``run(argv)`` is the same as a plain Beam entry point: crossfeed's flags are parsed with
``parse_known_args`` and everything else is handed to Beam, e.g.::

    python -m crossfeed.beam_jobs.job csv data.csv out/ --splits train=0.9,validation=0.1 --shards 8 \\
        --runner DaskRunner --dask_client_address tcp://scheduler:8786
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from crossfeed.beam_jobs.commit import remove_temporaries
from crossfeed.beam_jobs.policy import ErrorPolicy
from crossfeed.beam_jobs.runner import run_pipeline
from crossfeed.beam_jobs.sources import ReadSource, Source
from crossfeed.beam_jobs.splits import SplitSpec
from crossfeed.beam_jobs.write import WriteDataset
from crossfeed.errors import ConfigError
from crossfeed.write.writer import DEFAULT_SHARD_SIZE, check_target, read_manifest

log = logging.getLogger(__name__)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.I)


@dataclass(frozen=True)
class ConvertResult:
    path: str
    samples: dict[str, int]
    shards: dict[str, int]
    num_bytes: int
    seconds: float
    skipped: int

    @property
    def total_samples(self) -> int:
        return sum(self.samples.values())

    @property
    def samples_per_second(self) -> float:
        return self.total_samples / self.seconds if self.seconds > 0 else float("inf")


def parse_size(text: str | int) -> int:
    """``"256MB"``/``"256M"``/``"1.5GiB"``/``"4096"`` → bytes (K, M, G, T are powers of 1024)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"shard size {text!r} is not a size like 256MB, 1G or 4096")
    value = float(m[1]) * 1024 ** " kmgt".index((m[2] or " ").lower())
    if value < 1:
        raise ConfigError(f"shard size {text!r} must be at least one byte")
    return int(value)


def convert(
    source: Source,
    out,
    *,
    split: str = "train",
    splits: SplitSpec | str | None = None,
    num_shards: int | None = None,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    compress: bool = False,
    seed: int = 0,
    max_skips: int | None = None,
    runner: str | None = None,
    beam_args: Sequence[str] = (),
    on_progress: Callable[[int, int, float], None] | None = None,
    overwrite: bool = False,
) -> ConvertResult:
    """Convert ``source`` into split(s) of the dataset at ``out``; returns what was written.

    ``on_progress(samples, bytes, seconds)`` is called about twice a second while the job runs
    (samples encoded so far; works on any runner whose workers share ``out``'s filesystem). On
    failure the job's temporary files are removed and the error propagates. ``out`` must be new or
    empty; ``overwrite=True`` replaces the dataset there, all of it, in one atomic commit.
    """
    out = os.path.abspath(os.fspath(out))
    os.makedirs(out, exist_ok=True)
    check_target(out, overwrite=overwrite, clean=True)  # refuse before any work
    token = secrets.token_hex(6)
    write = WriteDataset(
        out,
        split=split,
        splits=splits,
        num_shards=num_shards,
        shard_size=parse_size(shard_size),
        schema=source.schema,
        compress=compress,
        metadata=source.metadata,
        seed=seed,
        batched=True,
        max_skips=max_skips,
        token=token,
        progress=on_progress is not None,
        overwrite=overwrite,
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
    return ConvertResult(
        out,
        {n: manifest.splits[n].num_records for n in names},
        {n: len(manifest.splits[n].shards) for n in names},
        sum(manifest.splits[n].num_bytes for n in names),
        seconds,
        int(manifest.metadata.get("skipped_records", 0)),
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
    """The source for ``kind`` (images, csv, parquet, numpy) with its options."""
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
    raise ConfigError(f"unknown source kind {kind!r}; use images, csv, parquet or numpy")


def run(argv: Sequence[str] | None = None) -> ConvertResult:
    """Command-line entry point (see the module doc); unknown flags go to Beam."""
    parser = argparse.ArgumentParser(prog="python -m crossfeed.beam_jobs.job")
    parser.add_argument("kind", choices=["images", "csv", "parquet", "numpy"])
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--split", default="train")
    parser.add_argument("--splits", default=None)
    parser.add_argument("--shards", type=int, default=None)
    parser.add_argument("--shard-size", default=str(DEFAULT_SHARD_SIZE))
    parser.add_argument("--compress", choices=["none", "gzip"], default="none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--on-error", choices=["raise", "skip"], default="raise")
    parser.add_argument("--max-skips", type=int, default=None)
    parser.add_argument("--label", default=None)
    parser.add_argument("--runner", default=None)
    known, beam_args = parser.parse_known_args(list(argv) if argv is not None else None)
    options: dict = {}
    if known.kind != "numpy":
        options["on_error"] = ErrorPolicy(known.on_error, known.max_skips)
    if known.label is not None and known.kind != "images":
        options["label"] = known.label
    source = make_source(known.kind, known.src, **options)
    return convert(
        source,
        known.out,
        split=known.split,
        splits=known.splits,
        num_shards=known.shards,
        shard_size=known.shard_size,
        compress=known.compress == "gzip",
        seed=known.seed,
        max_skips=known.max_skips,
        runner=known.runner,
        beam_args=beam_args,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    r = run()
    log.info(
        "%d samples in %d shards, %d bytes, %.1f s", r.total_samples, sum(r.shards.values()), r.num_bytes, r.seconds
    )
