"""What every conversion source is, and the PTransform that reads one.

A source is a small picklable object with a declared ``schema`` and ``metadata``, a list of
work ``units()`` (small descriptors in a fixed order, e.g. a file and a row range) and
``read(unit)``, which yields `records.SampleBatch` chunks with stable keys and batch ids. The
unit list is made on the launching machine; units are read in parallel by the runner's workers.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import apache_beam as beam

from crossfeed.beam_jobs.policy import EmptyInputError
from crossfeed.errors import ConfigError
from crossfeed.format.schema import Schema


@runtime_checkable
class Source(Protocol):
    schema: Schema
    metadata: dict

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
        return (pbegin | "Units" >> beam.Create(self._units, reshuffle=False)
                | "Read" >> beam.ParDo(_ReadUnit(self.source)))


class _ReadUnit(beam.DoFn):
    def __init__(self, source: Source):
        self.source = source

    def process(self, unit):
        yield from self.source.read(unit)


def list_files(src: str, extensions: tuple[str, ...], what: str) -> tuple[str, list[str]]:
    """``(root, relative paths)`` of ``src``: one file, or every file under a directory with one of
    ``extensions`` (case-insensitive), sorted."""
    src = os.fspath(src)
    if os.path.isfile(src):
        return os.path.dirname(os.path.abspath(src)), [os.path.basename(src)]
    if not os.path.isdir(src):
        raise ConfigError(f"{src}: no such file or directory")
    found = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.lower().endswith(extensions) and not name.startswith("."):
                found.append(os.path.relpath(os.path.join(dirpath, name), src).replace(os.sep, "/"))
    if not found:
        raise EmptyInputError(f"{src}: no {what} files ({', '.join(extensions)}) found")
    return os.path.abspath(src), sorted(found)
