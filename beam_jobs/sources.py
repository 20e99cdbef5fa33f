"""What every conversion source is, and the PTransform that reads one.

A source is a small picklable object with a declared ``schema`` and ``metadata``, a list of
work ``units()`` (small descriptors in a fixed order, e.g. a file and a row range) and
``read(unit)``, which yields `records.SampleBatch` chunks with stable keys and batch ids. The
unit list is made on the launching machine; units are read in parallel by the runner's workers.
A source may also name ``steps()``: ``(label, DoFn)`` pairs each batch goes through after it is
read (the text source's tokenizer, loaded once per worker in the DoFn's ``setup``),
``length_features``: the features whose per-record lengths the dataset keeps (lengths files), and
``reader()``: the copy of itself the read step ships to the workers, less what only its steps
need (the text source's tokenizer JSON: the runner pickles, compresses and loads each step's DoFn).
"""

from __future__ import annotations

import glob
import os
from typing import Protocol, runtime_checkable

import apache_beam as beam

from crossfeed.beam_jobs.policy import EmptyInputError
from crossfeed.errors import ConfigError
from crossfeed.format.schema import Schema


@runtime_checkable
class Source(Protocol):
    @property
    def schema(self) -> Schema: ...
    @property
    def metadata(self) -> dict: ...

    def units(self) -> list: ...

    def read(self, unit): ...


class ReadSource(beam.PTransform):
    """``pipeline | ReadSource(source)`` → PCollection of `SampleBatch`."""

    def __init__(self, source: Source):
        super().__init__()
        self.source = source
        self._units = list(source.units())
        if not self._units:
            raise EmptyInputError(f"{getattr(source, 'describe', lambda: source)()}: nothing to read")

    @property
    def num_units(self) -> int:
        return len(self._units)

    def expand(self, pbegin):
        out = (
            pbegin
            | "Units" >> beam.Create(self._units, reshuffle=False)
            | "Read" >> beam.ParDo(_ReadUnit(getattr(self.source, "reader", lambda: self.source)()))
        )
        for label, dofn in getattr(self.source, "steps", list)():
            out = out | label >> beam.ParDo(dofn)
        return out


class _ReadUnit(beam.DoFn):
    def __init__(self, source: Source):
        self.source = source

    def process(self, unit):
        yield from self.source.read(unit)


def list_files(src, extensions: tuple[str, ...], what: str) -> tuple[str, list[str]]:
    """``(root, relative paths)`` of ``src``: a file, a directory (every file under it with one of
    ``extensions``, case-insensitive), a glob pattern (``part-*.parquet``), or a list of these.
    ``root`` is the deepest folder holding them all; the paths are sorted and unique."""
    inputs = [os.fspath(src)] if isinstance(src, (str, os.PathLike)) else [os.fspath(s) for s in src]
    if not inputs:
        raise ConfigError(f"no {what} input given")
    paths: list[str] = []
    bases: list[str] = []  # a folder given is the root of what it holds (keys stay relative to it)
    for item in inputs:
        if os.path.isfile(item):
            paths.append(os.path.abspath(item))
        elif os.path.isdir(item):
            bases.append(os.path.abspath(item))
            found = _walk(item, extensions)
            if not found:
                raise EmptyInputError(f"{item}: no {what} files ({', '.join(extensions)}) found")
            paths += found
        elif glob.has_magic(item):
            matched = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matched:
                raise EmptyInputError(f"{item}: the pattern matches no {what} file")
            paths += [os.path.abspath(p) for p in matched]
        else:
            raise ConfigError(f"{item}: no such file or directory")
    paths = sorted(set(paths))
    root = os.path.commonpath(bases + [os.path.dirname(p) for p in paths])
    return root, [os.path.relpath(p, root).replace(os.sep, "/") for p in paths]


def _walk(folder: str, extensions: tuple[str, ...]) -> list[str]:
    """Absolute paths of the files under ``folder`` ending in one of ``extensions``; hidden ones skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.lower().endswith(extensions) and not name.startswith("."):
                found.append(os.path.abspath(os.path.join(dirpath, name)))
    return found
