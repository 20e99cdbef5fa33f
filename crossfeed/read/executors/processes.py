"""The process executor: worker processes build whole batches (fetch, decode, transform, batch)
into shared-memory slots (`crossfeed.read.executors.slots`); the parent yields them in plan order as views,
without pickling or copying their arrays. Python transforms then use every core, not one GIL.

    parent ── ("build", gen, seq, slot, sample ids) [+ slot fd] ──► worker seq % K
    parent ◄── ("done", gen, seq, slot, layout, nbytes, skipped, stage times, done at) ── worker
                                                          (the arrays are in the slot)

Worker w builds batches w, w+K, … of each pass, in order; the parent reads worker ``seq % K``'s
next reply for batch ``seq``, so the order (and thus `Loader.state_dict`) is the plan's. At most
``window`` batches are being built or wait unread. Workers are fresh interpreters
(``python -m crossfeed.read.executors.worker``: nothing of the parent's threads, TensorFlow or torch
state is inherited) that get the `WorkerRecipe` — the source, the options, the transforms as
``"module:function"`` references — and build their own Loader from it.

Nothing crosses the socket pickled (a message is JSON plus binary blobs: sample ids as int64
bytes, object-valued features in `crossfeed.format.wire` frames): what a worker sends is parsed,
never executed.

Failures: an exception in a worker reaches the consumer at the batch that raised (a crossfeed
error as itself, with a note naming the worker; anything else as `WorkerError` with the worker's
traceback); a worker that dies (``kill -9``, a segfault) is a `WorkerError` naming the batch it
was building and its exit signal — never a hang. A worker exits when its parent does (its
socket closes, and it watches its parent's pid); slots are anonymous memory, so nothing leaks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, cast

import numpy as np

from crossfeed import errors
from crossfeed.config import resolve_callable
from crossfeed.errors import ConfigError, CrossfeedError, WorkerError
from crossfeed.read.executors.slots import SlotLayout, SlotPool
from crossfeed.read.options import LoaderOptions, Source

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<QQI")  # body bytes, JSON bytes, blob count
_BLOB = struct.Struct("<Q")
_START_TIMEOUT = 120.0  # seconds for a worker to import and open the dataset


class Channel:
    """Length-prefixed messages over a Unix stream socket: a JSON value plus binary blobs, with
    file descriptors passed beside them (``SCM_RIGHTS``): a message sent with fds has them in
    `fds` once it is received. `recv` returns ``(value, blobs)``; nothing is unpickled."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()
        self.fds: deque[int] = deque()

    def send(self, obj, blobs=(), fds: tuple[int, ...] = ()) -> None:
        head = json.dumps(obj).encode()
        parts: list[bytes | memoryview] = [head]
        for b in blobs:
            b = memoryview(b).cast("B")
            parts += [_BLOB.pack(len(b)), b]
        msg = b"".join([_HEADER.pack(sum(map(len, parts)), len(head), len(blobs)), *parts])
        if fds:
            sent = socket.send_fds(self.sock, [msg], list(fds))
            msg = msg[sent:]
        if msg:
            self.sock.sendall(msg)

    def recv(self, timeout: float | None = None) -> tuple[Any, list[bytes]]:
        """The next message; EOFError when the other side is gone, TimeoutError after ``timeout``."""
        self.sock.settimeout(timeout)
        while True:
            if len(self._buf) >= _HEADER.size:
                n, text, count = _HEADER.unpack_from(self._buf)
                end = _HEADER.size + n
                if len(self._buf) >= end:
                    body = bytes(memoryview(self._buf)[_HEADER.size : end])
                    del self._buf[:end]
                    return _parse(body, text, count)
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 18, 16)
            except TimeoutError:
                raise TimeoutError("no message") from None
            except (ConnectionResetError, BrokenPipeError):
                data, fds = b"", []
            self.fds.extend(fds)
            if not data:
                raise EOFError("the other side closed")
            self._buf += data

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popleft())
        self.sock.close()


def _parse(body: bytes, text: int, count: int) -> tuple[Any, list[bytes]]:
    """``(value, blobs)`` of a message body: ``text`` bytes of JSON, then ``count`` blobs, each
    length-prefixed."""
    bad = "a malformed message between the process executor's processes"
    try:
        obj = json.loads(body[:text])
    except ValueError as e:
        raise WorkerError(f"{bad}: {e}") from None
    blobs, pos = [], text
    for _ in range(count):
        if pos + _BLOB.size > len(body):
            raise WorkerError(f"{bad}: truncated")
        (size,) = _BLOB.unpack_from(body, pos)
        pos += _BLOB.size
        if pos + size > len(body):
            raise WorkerError(f"{bad}: truncated")
        blobs.append(body[pos : pos + size])
        pos += size
    return obj, blobs


@dataclasses.dataclass(frozen=True)
class WorkerRecipe:
    """What a worker process needs to build the Loader's batches, sent to each as JSON.
    ``source``: a dataset path or URL, or a list of `crossfeed.Source`; ``transform`` and
    ``batch_transform``: module-level functions or ``"module:function"`` strings (sent as the
    latter: a worker imports them). ``manifests``: the sha256 of each source's manifest as the
    parent opened it; a worker that opens another version refuses (`check_versions`)."""

    source: object
    options: LoaderOptions
    transform: object = None
    batch_transform: object = None
    manifests: tuple = ()
    filter: object = None  # a predicate on each decoded sample (`crossfeed.read.stages.recipes`)
    transform_rng: bool = False  # the transform takes each sample's generator (found in the parent)
    batch_transform_rng: bool = False  # the batch transform takes each batch's generator (found in the parent)

    def check_versions(self, datasets) -> None:
        """A `DatasetRewrittenError` unless ``datasets`` (a worker's) hold the manifests the parent
        read: a worker must build the batches of the version the epoch was planned on."""
        for ds, want in zip(datasets, self.manifests):
            if want is not None and ds.manifest_sha256 != want:
                raise errors.DatasetRewrittenError(
                    f"{ds.path}: the dataset was rewritten while this reader had it open (a worker process "
                    f"found another manifest than the loader planned on); reopen it"
                )

    def at_kept_versions(self, datasets):
        """``source`` with each dataset (as a worker opened it) that was appended to since the
        parent read it pinned to the parent's version, kept as ``root@vN`` (None: none was): a
        reader goes on reading the version it opened."""
        at, moved = [], False
        for ds, want in zip(datasets, self.manifests):
            kept = [v for v, sha in ds.manifest.versions if sha == want] if want != ds.manifest_sha256 else []
            at.append(f"{ds.index_storage.root}@v{kept[0]}" if kept else None)
            moved = moved or bool(kept)
        if not moved:
            return None
        sources = _sources(self.source)
        if sources is None:
            return at[0]
        return [
            Source.from_json({**s, "path": p}) if p is not None else Source.from_json(s) for s, p in zip(sources, at)
        ]

    def to_json(self) -> dict:
        """The recipe as plain JSON values; a ConfigError, here in the caller's code, for what a
        worker could not rebuild (a lambda, a closure, a function defined in ``__main__``)."""
        sources = _sources(self.source)
        return {
            "source": os.fspath(cast("str | os.PathLike[str]", self.source)) if sources is None else sources,
            "options": self.options.flat(),
            "transform": _reference("transform", self.transform),
            "batch_transform": _reference("batch_transform", self.batch_transform),
            "manifests": list(self.manifests),
            "filter": _reference("filter", self.filter),
            "transform_rng": self.transform_rng,
            "batch_transform_rng": self.batch_transform_rng,
        }

    @staticmethod
    def from_json(d: dict) -> WorkerRecipe:
        src = d["source"]
        source = src if isinstance(src, str) else [Source.from_json(s) for s in src]
        manifests = tuple(d.get("manifests", ()))
        return WorkerRecipe(
            source,
            LoaderOptions.of(**d["options"]),
            d["transform"],
            d["batch_transform"],
            manifests,
            filter=d.get("filter"),
            transform_rng=bool(d.get("transform_rng", False)),
            batch_transform_rng=bool(d.get("batch_transform_rng", False)),
        )


def _sources(source) -> list[dict] | None:
    if isinstance(source, Source):
        source = [source]
    if isinstance(source, (list, tuple)):
        return [s.to_json() for s in source]
    return None


def _reference(name: str, fn) -> str | None:
    """``"module:qualname"`` of a transform, checked to import back to the very function."""
    if fn is None or isinstance(fn, str):
        return fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module == "__main__":
        raise ConfigError(
            f"executor='process': the {name} {qualname or fn!r} is defined in __main__, which worker processes "
            f"cannot import; move it to a module or pass 'module:function'"
        )
    spec = f"{module}:{qualname}"
    try:
        same = module is not None and "<" not in qualname and resolve_callable(spec) is fn
    except ConfigError:
        same = False
    if not same:
        raise ConfigError(
            f"executor='process' sends transforms to worker processes by reference (nothing is pickled), and the "
            f"{name} {fn!r} has none. Pass module-level functions (not lambdas or closures) or 'module:function' "
            f"strings"
        )
    return spec


def exception_to_json(e: BaseException) -> dict | None:
    """A crossfeed error as ``{"type", "args"}`` for `exception_from_json` (None for anything
    else, or for arguments that are not plain values): it crosses as itself, as data."""
    if not isinstance(e, CrossfeedError) or getattr(errors, type(e).__name__, None) is not type(e):
        return None
    args = e.__reduce__()[1]
    if not all(isinstance(a, (str, int, float, bool)) or a is None for a in args):
        return None
    return {"type": type(e).__name__, "args": list(args)}


def exception_from_json(d) -> CrossfeedError | None:
    """The crossfeed error `exception_to_json` described, or None: only classes of
    `crossfeed.errors` are made, from plain values."""
    if not isinstance(d, dict):
        return None
    cls = getattr(errors, str(d.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, CrossfeedError)) or not isinstance(d.get("args"), list):
        return None
    try:
        return cls(*d["args"])
    except Exception:
        return None


def layout_to_json(layout: SlotLayout) -> tuple[list, list]:
    """A slot layout as JSON plus blobs: arrays by ``(key, dtype, shape, offset)``; object-valued
    features (strings, ragged lists) encoded in `crossfeed.format.wire` frames."""
    from crossfeed.format import wire

    objects = {k: v for k, dtype, v, _ in layout if dtype is None}
    rows = [
        [k, None if dtype is None else dtype.str, None if dtype is None else list(shape), off]
        for k, dtype, shape, off in layout
    ]
    return rows, (wire.encode(objects) if objects else [])


def layout_from_json(rows, blobs: list[bytes]) -> SlotLayout:
    from crossfeed.format import wire

    objects = wire.decode(blobs)[1] if blobs else {}
    return [
        (k, None, objects[k], -1) if dtype is None else (k, np.dtype(dtype), tuple(shape), off)
        for k, dtype, shape, off in rows
    ]


class _Worker:
    def __init__(self, index: int, proc: subprocess.Popen, channel: Channel):
        self.index, self.proc, self.channel = index, proc, channel
        self.known: set[int] = set()  # slot ids whose fd this worker has

    def died(self, what: str) -> WorkerError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        elif code is not None:
            how = f"exited with status {code}"
        else:
            how = "closed its socket"
        return WorkerError(f"worker process {self.index} (pid {self.proc.pid}) {how} while {what}")


class ProcessExecutor:
    """``processes`` worker processes building the batches of `map`, in order, at most
    ``window`` ahead of the consumer (the `crossfeed.read.executors.threads.ThreadExecutor` contract, in
    processes). The workers start at the first `map` and serve every later one until `close`.

    Batch lifetime: a batch's arrays are views onto its slot, which is reused only once none of
    them (nor any view of them) is referenced: keep a batch as long as you like, no copy needed.
    """

    def __init__(
        self, recipe: WorkerRecipe, processes: int, window: int, *, name: str = "crossfeed-loader", meter=None
    ):
        """``meter``: a `crossfeed.read.metrics.Meter` that each batch's stage times (sent by
        its worker with it) and hand-over are added to."""
        if processes < 1 or window < 1:
            raise ConfigError(f"a process executor needs processes >= 1 and window >= 1, got {processes}, {window}")
        if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
            raise ConfigError(
                "executor='process' needs Linux (anonymous shared memory: memfd_create); use threads here"
            )
        self.processes, self.window, self._name = processes, max(window, processes), name
        self.num_threads = 0  # no builder threads in this process: the workers build
        self._recipe = recipe.to_json()  # fails here, in the caller's code, if it cannot be sent
        self._workers: list[_Worker] = []
        self._pools = [SlotPool()]  # the current one last; torn-down ones close as their batches go
        self._gen = 0
        self._skipped = [0, 0]  # on_error="skip": records skipped by stopped workers, and by these
        self._filtered = [0, 0]  # samples the workers' filters dropped: by stopped workers, and by these
        self.epoch = 0  # the epoch of the batches `map` sends (each sample's generator is keyed by it)
        self._closed = False
        self.meter = meter
        weakref.finalize(self, _stop_workers, self._workers, self._pools, os.getpid())  # if never closed

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (empty before the first `map`)."""
        return [w.proc.pid for w in self._workers]

    @property
    def skipped(self) -> int:
        """Bad records the workers skipped (``on_error="skip"``; each worker has its own budget)."""
        return self._skipped[0] + sum(self._skipped[1:])

    @property
    def filtered(self) -> int:
        """Samples the workers' filters (or transforms returning None) dropped."""
        return self._filtered[0] + sum(self._filtered[1:])

    @property
    def slots(self) -> int:
        """Shared-memory slots made so far (about ``window`` plus the batches kept by the consumer)."""
        return len(self._pools[-1])

    def map(self, build, items: Iterable) -> Iterator[dict]:
        """``build(item)`` of each item, in order, built by the workers' own builders (``build``,
        the caller's, is not sent: the workers made theirs from the recipe)."""
        if self._closed:
            raise ConfigError("this process executor is closed")
        if not self._workers:
            self._start()
        self._gen += 1
        return self._run(self._gen, iter(items))

    def _start(self) -> None:
        self._skipped = [self._skipped[0]] + [0] * self.processes
        self._filtered = [self._filtered[0]] + [0] * self.processes
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            for i in range(self.processes):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                with theirs:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "crossfeed.read.executors.worker", str(theirs.fileno())],
                        pass_fds=(theirs.fileno(),),
                        stdin=subprocess.DEVNULL,
                        env=env,
                    )
                worker = _Worker(i, proc, Channel(ours))
                self._workers.append(worker)
                worker.channel.send(["init", list(sys.path), i, self._recipe])
            for w in self._workers:
                msg, _ = self._recv(w, "starting (importing and opening the dataset)", timeout=_START_TIMEOUT)
                if msg[0] == "error":
                    if isinstance(err := exception_from_json(msg[4]), errors.DatasetRewrittenError):
                        raise err  # what the caller must do (reopen), not a worker's failure
                    raise WorkerError(f"worker process {w.index} (pid {w.proc.pid}) could not start:\n{msg[3]}")
        except BaseException:
            self._teardown()
            raise
        log.info("%s: %d worker processes started: %s", self._name, len(self._workers), self.pids)

    def _recv(self, w: _Worker, what: str, timeout: float | None = None):
        try:
            return w.channel.recv(timeout)
        except EOFError:
            err = w.died(what)
        except TimeoutError:
            err = WorkerError(
                f"worker process {w.index} (pid {w.proc.pid}) did not answer in {timeout:.0f} s while {what}"
            )
        self._teardown()  # the others are torn down too: the next pass starts fresh ones
        raise err

    def _run(self, gen: int, items: Iterator) -> Iterator[dict]:
        workers, pool, k = self._workers, self._pools[-1], len(self._workers)
        sent = got = 0
        firsts: deque = deque()  # what each batch in flight starts with, for error messages

        def submit() -> bool:
            nonlocal sent
            item = next(items, _END)
            if item is _END:
                return False
            w, slot = workers[sent % k], pool.take()
            new = slot.id not in w.known
            try:
                ids = np.ascontiguousarray(item, dtype="<i8")
                epoch = int(getattr(item, "epoch", self.epoch))  # tagged ids carry theirs (`recipes.tag`)
                step = int(getattr(item, "step", -1))  # and their global step (a batch transform's generator)
                w.channel.send(["build", gen, sent, slot.id, epoch, step], [ids], (slot.fd,) if new else ())
            except OSError:  # it died: name the batch it was building, if it held one
                pool.release(slot.id)
                held = [q for q in range(got, sent) if q % k == w.index]
                err = w.died(f"building batch {held[0]} of this pass" if held else f"receiving batch {sent}")
                self._teardown()
                raise err from None
            w.known.add(slot.id)
            firsts.append(_first(item))
            sent += 1
            return True

        # replies still in flight when a pass is abandoned are recognised by their pass number
        # at the next pass, and their slots released
        while sent - got < self.window and submit():
            pass
        while got < sent:
            if self._gen != gen or not self._workers:
                raise ConfigError("the executor began another pass or was closed; this earlier iterator cannot go on")
            w = workers[got % k]
            what = f"building batch {got} of this pass (first sample id {firsts[0]})"
            msg, blobs = self._recv(w, what)
            while msg[1] != gen:  # a reply to an abandoned pass: its slot is free again
                if msg[0] == "done":
                    pool.release(msg[3])
                msg, blobs = self._recv(w, what)
            if msg[0] == "error":
                raise _worker_exception(w, what, msg[3], msg[4])
            _, _, _, slot_id, rows, nbytes, self._skipped[1 + w.index] = msg[:7]
            batch = pool.batch(slot_id, layout_from_json(rows, blobs), nbytes)
            if self.meter is not None and len(msg) >= 9:  # the batch's stage times, and when it was done
                self.meter.merge(msg[7], msg[8])
            if len(msg) >= 10:
                self._filtered[1 + w.index] = int(msg[9])
            got += 1
            firsts.popleft()
            submit()
            yield batch

    def close(self) -> None:
        """Stop the workers (batches already yielded stay valid) and close the slots."""
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        self._skipped = [self.skipped]
        self._filtered = [self.filtered]
        _stop_workers(self._workers, self._pools)
        if not self._closed:
            self._pools.append(SlotPool())


def _stop_workers(workers: list[_Worker], pools: list[SlotPool], owner: int | None = None) -> None:
    """Stop the workers at once (they hold nothing to flush) and close the pools — only in the
    process that started them (a forked child exiting must not stop its parent's workers)."""
    if owner is not None and os.getpid() != owner:
        return
    for w in workers:
        w.channel.close()
        if w.proc.poll() is None:
            w.proc.terminate()
    for w in workers:
        try:
            w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
    workers.clear()
    for pool in pools:
        pool.close()
    del pools[:-1]  # closed pools close their remaining slots as those batches are dropped


def _worker_exception(w: _Worker, what: str, text: str, exc) -> BaseException:
    """The error to raise for a worker's exception: a crossfeed error as itself (with a note),
    anything else as a `WorkerError` carrying the worker's traceback."""
    where = f"in worker process {w.index} (pid {w.proc.pid}) while {what}"
    e = exception_from_json(exc)
    if e is not None:
        if sys.version_info >= (3, 11):  # no notes before 3.11
            e.add_note(f"raised {where}")
        return e
    return WorkerError(f"an exception was raised {where}:\n{text}")


def _first(item) -> object:
    try:
        return int(item[0]) if len(item) else None
    except (TypeError, IndexError, ValueError):
        return None


_END = object()
