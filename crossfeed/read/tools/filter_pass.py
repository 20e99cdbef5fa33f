"""A filter pass: run a predicate over every stored sample once, write the ids it drops as a skip
file (`crossfeed.read.skips`), so a filter is planned before training like any skip.

    crossfeed.filter_pass("data/", "mymod:keep", out="filtered.txt")               # shorter steps
    crossfeed.filter_pass("data/", "mymod:keep", out="filtered.txt", refill=True)  # full steps
    Loader("data/", batch_size=64, skip="filtered.txt")                            # reads the plan
    Loader("tok/", batch_size=8, pack=Pack(2048), skip="filtered.txt")             # packed too

``filter=`` on the Loader drops samples as they are built: their steps come out shorter, and a
token pipeline (``pack=``, ``batch_by_tokens=``), which plans rows from the documents' lengths
before any is read, cannot take it. The pass decides the same question once, ahead: it reads each
sample of the split (a mixture: each source's, its sources numbered as ``skip=`` numbers them) in
stored order, decoded as the Loader decodes it (the same reader, the same ``features=``, image and
error options) and hands each to the predicate, as ``filter=`` would. The ids it rejects become
``SOURCE INDEX`` lines, with ``#`` comments naming the filter, the datasets and the counts, and a
``refill`` line under ``refill=True``: the Loader then closes the epoch's order up around them,
so every step is full (a mixture: each source's passes; not with per-sample weights or token
pipelines: `crossfeed.read.skips`). Without refill a
filtered sample is accounted exactly like a skipped one (its step shorter; in a token plan, a
document of length 0).

Bounded: only the dropped ids are held (at most `crossfeed.read.skips.MAX_SAMPLES`, else a
ConfigError before anything is written); the file is written whole to a temporary name and
renamed over ``out``. A predicate must return a bool (numpy's too): anything else is refused,
naming the filter and the sample. ``max_filtered=`` (a share) refuses a filter that drops more.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator

import numpy as np

from crossfeed.config import resolve_callable
from crossfeed.errors import ConfigError, redact
from crossfeed.read import skips
from crossfeed.read.options import LoaderOptions
from crossfeed.read.stages.recipes import callable_name

__all__ = ["FilterPass", "filter_pass"]

CHUNK = 1024  # samples read and filtered at a time
_PLAN_ONLY = ("pack", "batch_by_tokens", "weights", "skip")  # what the Loader that reads the file takes


@dataclasses.dataclass(frozen=True)
class FilterPass:
    """What a pass wrote: ``path`` (the skip file), the samples ``seen``, ``dropped`` and
    ``unreadable`` (bad records skipped under ``on_error="skip"``: the Loader skips them
    again), per source (``sources``: its path, seen, dropped), and whether it ``refill``\\ s."""

    path: str
    seen: int
    dropped: int
    unreadable: int
    refill: bool
    sources: tuple[tuple[str, int, int], ...]

    @property
    def kept(self) -> int:
        return self.seen - self.dropped

    @property
    def skip(self) -> skips.Skip:
        """The file read back (what ``skip=path`` gives the Loader)."""
        s = skips.Skip.of(self.path)
        assert s is not None
        return s


def filter_pass(
    source,
    filter: Callable[[dict], bool] | str,
    out: str | os.PathLike,
    *,
    refill: bool = False,
    options: LoaderOptions | None = None,
    chunk: int = CHUNK,
    **fields,
) -> FilterPass:
    """Run ``filter`` (a predicate on the decoded sample, or ``"module:function"``) over every
    sample of ``source`` (a dataset or a mixture of `crossfeed.Source`) and write the ids it
    rejects to ``out`` as a skip file (module docstring); ``refill``: the file says ``refill``.
    ``options`` (a `LoaderOptions`), or its fields as keywords (``split=``, ``features=``,
    ``decode_images=``, ``storage_options=``, ``on_error=``, ``num_threads=``, ``max_filtered=`` …)
    say what the Loader reads; the plan's options are not the pass's (it reads stored order):
    ``pack=``, ``batch_by_tokens=``, ``weights=`` and ``skip=`` are refused by name."""
    from crossfeed.read.pipeline import Pipeline

    if not isinstance(refill, bool):
        raise ConfigError(f"filter pass refill: True or False, got {refill!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"filter pass chunk: a positive number of samples, got {chunk!r}")
    if options is None:
        fields.setdefault("batch_size", chunk)
    options = LoaderOptions.given(options, fields, who="filter_pass")
    given = [name for name in _PLAN_ONLY if getattr(options.plan, name) is not None]
    if given:
        raise ConfigError(
            f"filter_pass reads every stored sample once, in stored order: {', '.join(f'{g}=' for g in given)} "
            "belong to the Loader that reads its file (Loader(src, skip=FILE, pack=…)); leave them out here"
        )
    name = filter if isinstance(filter, str) else callable_name(filter)
    pred = resolve_callable(filter, option="filter") if isinstance(filter, str) else filter
    if not callable(pred):
        raise ConfigError(f"filter_pass filter= must be a predicate or 'module:function', got {filter!r:.80}")
    options = options.replace(
        batch_size=chunk, shuffle="none", executor="thread", rank=0, world_size=1, worker=0, num_workers=1
    )
    with Pipeline.build(source, options) as pipeline:
        where = [redact(str(ds.path)) for ds in pipeline.datasets]
        starts = pipeline.starts.tolist()

        def run(item: tuple[int, int, int]) -> tuple[int, int, np.ndarray, int]:
            s, lo, hi = item
            ids = np.arange(starts[s] + lo, starts[s] + hi, dtype=np.int64)
            batch, kept = pipeline.decoded(ids)
            items = list(batch.items())
            rows = np.asarray(kept, dtype=np.int64).tolist()
            gone = []
            for i, j in enumerate(rows):
                verdict = pred({k: v[i] for k, v in items})
                if not isinstance(verdict, (bool, np.bool_)):
                    raise ConfigError(
                        f"filter {name} returned a {type(verdict).__name__} for sample {lo + j} of source {s} "
                        f"({where[s]}); a filter returns True (keep) or False (drop)"
                    )
                if not verdict:
                    gone.append(lo + j)
            return s, len(rows), np.asarray(gone, dtype=np.int64), (hi - lo) - len(rows)

        def chunks() -> Iterator[tuple[int, int, int]]:
            for s in range(len(starts) - 1):
                n = starts[s + 1] - starts[s]
                for lo in range(0, n, chunk):
                    yield s, lo, min(n, lo + chunk)

        seen = [0] * (len(starts) - 1)
        dropped: list[list[np.ndarray]] = [[] for _ in seen]
        total_dropped = unreadable = 0
        for s, n, gone, bad in pipeline.map(run, chunks()):
            seen[s] += n
            unreadable += bad
            dropped[s].append(gone)
            total_dropped += len(gone)
            if total_dropped > skips.MAX_SAMPLES:
                raise ConfigError(
                    f"filter {name} drops more than {skips.MAX_SAMPLES:,} samples, the most a skip file holds "
                    f"(crossfeed.read.skips.MAX_SAMPLES); nothing was written to {os.fspath(out)}: filter these "
                    "samples out when converting, or split the dataset"
                )
    total = sum(seen)
    if total and total_dropped == total:
        raise ConfigError(
            f"filter {name} drops all {total:,} samples of {', '.join(where)}; nothing would be left to read "
            f"and nothing was written to {os.fspath(out)}"
        )
    share = options.read.max_filtered
    if share is not None and total and total_dropped / total > share:
        raise ConfigError(
            f"filter {name} drops {total_dropped:,} of {total:,} samples ({total_dropped / total:.1%}), more than "
            f"max_filtered={share}; nothing was written to {os.fspath(out)}: check the filter or raise max_filtered"
        )
    ids = [np.concatenate(d) if d else np.zeros(0, np.int64) for d in dropped]
    lines = [
        f"# crossfeed filter pass: filter {_one_line(name)}",
        f"# split {_one_line(options.split)}; features {_one_line(str(list(options.features or ['all'])))}",
    ]
    for s, w in enumerate(where):
        lines.append(
            f"# source {s}: {_one_line(w)}: {seen[s]:,} samples read, {seen[s] - len(ids[s]):,} kept, "
            f"{len(ids[s]):,} dropped"
        )
    lines.append(f"# kept {total - total_dropped:,}, dropped {total_dropped:,} of {total:,} samples")
    if unreadable:
        lines.append(f"# {unreadable:,} unreadable records skipped (on_error=skip): not listed, the Loader skips them")
    lines.append("# lines: SOURCE INDEX (crossfeed.read.skips); read with Loader(..., skip=THIS_FILE)")
    if refill:
        lines.append("refill")
    path = os.fspath(out)
    _write_atomic(path, lines, ids)
    return FilterPass(
        path=path,
        seen=total,
        dropped=total_dropped,
        unreadable=unreadable,
        refill=refill,
        sources=tuple((w, seen[s], len(ids[s])) for s, w in enumerate(where)),
    )


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _write_atomic(path: str, head: list[str], ids: list[np.ndarray]) -> None:
    """``head`` and one ``SOURCE INDEX`` line per id, written to a temporary file beside ``path``
    and renamed over it (a reader sees the old file or the whole new one)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(head) + "\n")
            for s, idx in enumerate(ids):
                for lo in range(0, len(idx), 1 << 16):
                    f.write("".join(f"{s} {i}\n" for i in idx[lo : lo + (1 << 16)].tolist()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise ConfigError(f"filter pass: cannot write the skip file {path} ({e}); give a writable --out") from None
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
