"""Progress bars for long CLI work (convert, index, verify, bench): the phase name, done/total,
rate and ETA on stderr, drawn by rich (installed with typer). Quiet when stderr is not a
terminal, so logs and pipes stay clean.

    with Progress() as progress:
        bar = progress.phase("verifying", total=nbytes, unit="bytes")
        bar.advance(n)            # or bar.update(done, total)
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress


class Phase:
    """One named bar; `advance` adds to it, `update` sets it (and the total when known)."""

    def __init__(self, progress: Any, task: Any):
        self._progress, self._task = progress, task

    def advance(self, n: float = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def update(self, done: float, total: float | None = None) -> None:
        if self._progress is not None:
            kwargs = {"completed": done}
            if total is not None:
                kwargs["total"] = total
            self._progress.update(self._task, **kwargs)

    def callback(self, done: float, total: float | None = None) -> None:
        """For library ``progress=`` hooks of either kind: ``f(increment)`` or ``f(done, total)``."""
        if total is None:
            self.advance(done)
        else:
            self.update(done, total)


class Progress:
    """A context manager of phases; draws only when ``enabled`` (default: stderr is a terminal)."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._rich: RichProgress | None = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                MofNCompleteColumn,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as RichProgress

            class _Count(MofNCompleteColumn):  # items: "123/456"; bytes: "1.2/3.4 MB"
                def render(self, task):
                    return DownloadColumn().render(task) if task.fields.get("unit") == "bytes" else super().render(task)

            class _Rate(TransferSpeedColumn):  # items: "1,234 samples/s"; bytes: "12.3 MB/s"
                def render(self, task):
                    if task.fields.get("unit") == "bytes":
                        return super().render(task)
                    from rich.text import Text

                    speed = task.finished_speed or task.speed
                    return Text(
                        "?" if speed is None else f"{speed:,.0f} {task.fields.get('unit')}/s",
                        style="progress.data.speed",
                    )

            self._rich = RichProgress(
                TextColumn("{task.description:<16}"),
                BarColumn(),
                TaskProgressColumn(),
                _Count(),
                _Rate(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._rich.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)
            self._rich = None

    def phase(self, name: str, total: float | None = None, unit: str = "samples") -> Phase:
        """A new bar named ``name`` (reading, encoding, writing shards, verifying …)."""
        if self._rich is None:
            return Phase(None, None)
        return Phase(self._rich, self._rich.add_task(name, total=total, unit=unit))
