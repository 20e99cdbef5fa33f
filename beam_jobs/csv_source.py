"""CSV files (one file, or every ``.csv``/``.tsv`` under a directory; one work unit per file).

Options for odd files: ``header=False`` (no header line; names from ``names`` or ``col0…``),
``names`` (replace the header's names), ``skip_rows`` (lines before the header, e.g. comments),
``delimiter``, ``types`` (``{"age": "int64"}``; other columns are inferred from the first
``infer_rows`` rows of the first file; `report()` says what was decided and why, naming cells by
``file:line``), ``label`` (the column stored as ``label``; a string label becomes a class index
with ``class_names`` in the metadata unless ``label_classes=False`` — the vocabulary takes one
pass over the label column of every file when the job starts). A row with the wrong number of
fields or a value that does not parse is reported as ``file:line`` under the ``on_error`` policy.
Keys are ``<file>:<line>``.
"""

from __future__ import annotations

import csv
import itertools
import os
from dataclasses import dataclass

import numpy as np

from crossfeed.beam_jobs.policy import EmptyInputError, ErrorPolicy, Skips
from crossfeed.beam_jobs.records import SampleBatch
from crossfeed.beam_jobs.sources import list_files
from crossfeed.beam_jobs.tabular import (
    ColumnType,
    Inference,
    convert_strings,
    drop_rows,
    encode_labels,
    feature_name,
    infer_column,
    narrowed_lines,
    parse_types,
    table_metadata,
    table_schema,
    vocabulary,
)
from crossfeed.errors import ConfigError
from crossfeed.format.schema import Schema

EXTENSIONS = (".csv", ".tsv")


@dataclass(frozen=True)
class CsvSource:
    root: str
    files: tuple[str, ...]
    columns: tuple[tuple[str, ColumnType], ...]
    label: str | None = None
    header: bool = True
    skip_rows: int = 0
    delimiter: str = ","
    encoding: str = "utf-8"
    on_error: ErrorPolicy = ErrorPolicy()
    batch_rows: int = 8192
    classes: tuple[str, ...] | None = None  # a string label's vocabulary: stored as class indices
    inferred: tuple[Inference, ...] = ()

    @classmethod
    def scan(
        cls,
        src,
        *,
        names=None,
        header: bool = True,
        skip_rows: int = 0,
        delimiter: str = ",",
        types=None,
        label: str | None = None,
        on_error: ErrorPolicy = ErrorPolicy(),
        batch_rows: int = 8192,
        encoding: str = "utf-8",
        infer_rows: int = 1000,
        label_classes: bool = True,
    ) -> CsvSource:
        if skip_rows < 0 or batch_rows < 1 or len(delimiter) != 1:
            raise ConfigError("skip_rows must be >= 0, batch_rows >= 1 and the delimiter one character")
        root, files = list_files(src, EXTENSIONS, "CSV")
        declared = parse_types(types)
        head, sample = _peek(os.path.join(root, files[0]), header, skip_rows, delimiter, encoding, infer_rows)
        if names:
            names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)]
        elif header:
            names = head
        elif sample:
            names = [f"col{i}" for i in range(len(sample[0][1]))]
        if not names:
            raise EmptyInputError(f"{os.path.join(root, files[0])}: no header and no rows; nothing to convert")
        if len(set(names)) != len(names) or not all(names):
            raise ConfigError(f"{files[0]}: column names {names} are empty or repeat; pass names=/--names")
        unknown = set(declared) - set(names)
        if unknown:
            raise ConfigError(f"types given for unknown columns {sorted(unknown)}; the columns are {names}")
        cols, inferred = [], []
        for i, n in enumerate(names):
            if n in declared:
                cols.append((n, declared[n]))
                continue
            guess = infer_column(n, [(f"{files[0]}:{line}", r[i]) for line, r in sample if len(r) == len(names)])
            cols.append((n, guess.type))
            inferred.append(guess)
        for rel in files[1:]:
            other, _ = _peek(os.path.join(root, rel), header, skip_rows, delimiter, encoding, 0)
            if header and other != head:
                raise ConfigError(f"{rel}: header {other} differs from {files[0]}'s {head}")
        table_schema(cols, label)  # validates the label
        classes = None
        if label is not None and label_classes and dict(cols)[label] is ColumnType.STRING:
            at = names.index(label)
            classes = label_classes_of(root, files, at, header, skip_rows, delimiter, encoding, label)
        return cls(
            root,
            tuple(files),
            tuple(cols),
            label,
            header,
            skip_rows,
            delimiter,
            encoding,
            on_error,
            batch_rows,
            classes,
            tuple(inferred),
        )

    @property
    def schema(self) -> Schema:
        return table_schema(list(self.columns), self.label, self.classes)

    @property
    def metadata(self) -> dict:
        return table_metadata("csv", self.label, self.classes, self.inferred, narrowed_lines(self.columns))

    def report(self) -> list[str]:
        """What inference decided for each column and why; the label's classes."""
        lines = [("warning: " if i.warn else "") + i.why for i in self.inferred]
        lines += list(narrowed_lines(self.columns).values())
        if self.classes is not None:
            shown = ", ".join(self.classes[:10]) + (" …" if len(self.classes) > 10 else "")
            lines.append(
                f"label {self.label!r}: {len(self.classes)} classes ({shown}) stored as indices 0..{len(self.classes) - 1}; "
                f"names in the manifest (class_names); --no-label-classes keeps the strings"
            )
        return lines

    def describe(self) -> str:
        return f"CSV {self.root} ({len(self.files)} files)"

    def units(self) -> list[tuple[int, str]]:
        return list(enumerate(self.files))

    def read(self, unit):
        number, rel = unit
        path = os.path.join(self.root, rel)
        skips = Skips(self.on_error)
        ncols = len(self.columns)
        with open(path, newline="", encoding=self.encoding) as f:
            for _ in range(self.skip_rows):
                f.readline()
            reader = csv.reader(f, delimiter=self.delimiter)
            line, reported = self.skip_rows, 0
            if self.header:
                next(reader, None)
                line = self.skip_rows + reader.line_num
            for chunk in itertools.count():
                rows, keys, start = [], [], line
                for row in reader:
                    first, line = line + 1, self.skip_rows + reader.line_num
                    if not row:
                        continue
                    if len(row) != ncols:
                        skips.bad(f"{path}:{first}: expected {ncols} fields, got {len(row)}")
                        continue
                    rows.append(row)
                    keys.append(f"{rel}:{first}")
                    if len(rows) >= self.batch_rows:
                        break
                if not rows and line == start:
                    break
                batch = self._batch(f"csv-{number:05d}-{chunk:06d}", rows, keys, path, skips)
                batch.skipped, reported = skips.count - reported, skips.count
                if len(batch) or batch.skipped:
                    yield batch

    def _batch(self, batch_id: str, rows: list[list[str]], keys: list[str], path: str, skips: Skips) -> SampleBatch:
        columns, bad = {}, set()
        for (name, typ), values in zip(self.columns, zip(*rows) if rows else [()] * len(self.columns)):
            col: np.ndarray | list
            if self.classes is not None and name == self.label:
                col, errors = encode_labels(list(values), self.classes, name)
            else:
                col, errors = convert_strings(list(values), typ, name)
            for i, why in sorted(errors.items()):
                if i not in bad:
                    skips.bad(f"{path}:{keys[i].rsplit(':', 1)[1]}: {why}")
                    bad.add(i)
            columns[feature_name(name, self.label)] = col
        columns, keys = drop_rows(columns, keys, bad)
        return SampleBatch(batch_id, keys, columns)


def _peek(path: str, header: bool, skip_rows: int, delimiter: str, encoding: str, n: int):
    """``(header row or None, first n data rows as (line, row))`` of a CSV file."""
    with open(path, newline="", encoding=encoding) as f:
        for _ in range(skip_rows):
            f.readline()
        reader = csv.reader(f, delimiter=delimiter)
        head = next(reader, None) if header else None
        rows = []
        for r in itertools.islice(reader, n):
            if r:
                rows.append((skip_rows + reader.line_num, r))
    return ([h.strip() for h in head] if head is not None else None), rows


def label_classes_of(
    root: str, files, at: int, header: bool, skip_rows: int, delimiter: str, encoding: str, name: str
) -> tuple[str, ...]:
    """The sorted vocabulary of column ``at`` over every file (one pass over the label column)."""
    values: set[str] = set()
    for rel in files:
        with open(os.path.join(root, rel), newline="", encoding=encoding) as f:
            for _ in range(skip_rows):
                f.readline()
            reader = csv.reader(f, delimiter=delimiter)
            if header:
                next(reader, None)
            values.update(r[at] for r in reader if len(r) > at)
    return vocabulary(values, name)
