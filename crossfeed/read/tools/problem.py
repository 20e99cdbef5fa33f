"""What `crossfeed verify` reports: one `Problem` per thing wrong, with the file and byte offset."""

from __future__ import annotations

from dataclasses import dataclass

from crossfeed.errors import redact


@dataclass(frozen=True)
class Problem:
    """One thing wrong: the file, the byte offset (None when the whole file is concerned), why."""

    file: str
    offset: int | None
    reason: str

    def __str__(self) -> str:
        where = f"{self.file}: byte offset {self.offset}" if self.offset is not None else self.file
        return redact(f"{where}: {self.reason}")
