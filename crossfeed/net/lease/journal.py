"""The dispatcher's journal: JSON lines appended and fsync'ed before the change is answered.

`Journal(path).read()` gives the records of a previous run (a torn last line, from a crash in
mid-write, is ignored: its change was never answered); `append(records)` writes and fsyncs;
`compact(snapshot)` replaces the file with the given records (written to a temporary file,
fsync'ed, renamed over the journal, the directory fsync'ed), once it holds `compact_after` lines.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from crossfeed.errors import ConfigError

logger = logging.getLogger(__name__)


class Journal:
    def __init__(self, path: str | os.PathLike, *, compact_after: int = 10_000):
        self.path = Path(path)
        self.compact_after = compact_after
        self._lines = 0
        self._file = None

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        records = []
        lines = self.path.read_bytes().split(b"\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                if i == len(lines) - 1:  # torn last line: never answered
                    logger.warning("ignoring a torn last line in journal %s", self.path)
                    break
                raise ConfigError(
                    f"journal {self.path} line {i + 1} is corrupt ({e}); move it away to start the plan afresh"
                ) from e
            records.append(record)
        self._lines = len(records)
        return records

    def append(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")
        self._file.write(b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._lines += len(records)

    def due(self) -> bool:
        return self._lines >= self.compact_after

    def compact(self, snapshot: list[dict[str, Any]]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in snapshot))
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
        self._lines = len(snapshot)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
