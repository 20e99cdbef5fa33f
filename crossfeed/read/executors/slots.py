"""Shared-memory batch slots: where the process executor's workers build batches that the parent
hands on without copying or pickling their arrays.

A slot is an anonymous memory file (``os.memfd_create``): no name in ``/dev/shm`` or anywhere
else, so nothing can outlive the processes that hold it — the kernel frees it when the last file
descriptor and the last mapping are gone, whether they closed or were killed (``kill -9``
included). The parent creates the slots and passes their descriptors to workers over a Unix
socket (``SCM_RIGHTS``); a worker grows a slot (``ftruncate``) when a batch needs more room.

Layout of a batch in a slot: each array at a 64-byte aligned offset, described by
``(key, dtype, shape, offset)``; values that cannot live in flat memory (object arrays: strings,
ragged lists) travel beside the layout, ``(key, None, value, -1)`` (over the socket in
`crossfeed.format.wire` frames: `crossfeed.read.executors.processes.layout_to_json`).

Lifetime (`read_batch`): the arrays of a batch are views onto one per-batch base array over the
slot's mapping; the slot goes back to the pool only when that base is freed, i.e. when no array
of the batch, and no view, slice or tensor made from one without a copy, is referenced any more.
A slot is therefore never reused under a live array, whatever the consumer keeps; a consumer that
keeps many batches keeps many slots (memory grows as it would with the threads' batches).
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

ALIGN = 64
# (key, dtype, shape, offset) of an array in the slot; (key, None, the value itself, -1) of any other
SlotLayout = list[tuple[str, "np.dtype | None", Any, int]]


class Slot:
    """One memfd region: its descriptor, its id, and this process's mapping of it."""

    def __init__(self, fd: int, slot_id: int):
        self.fd, self.id = fd, slot_id
        self._map: mmap.mmap | None = None

    @classmethod
    def create(cls, slot_id: int) -> Slot:
        return cls(os.memfd_create(f"crossfeed-batch-{slot_id}", os.MFD_CLOEXEC), slot_id)

    def mapping(self, nbytes: int, *, grow: bool = False) -> mmap.mmap:
        """A mapping covering at least ``nbytes``; with ``grow`` the file is enlarged first (the
        worker that fills the slot), else it must already be that large (the parent, told)."""
        if self._map is not None and len(self._map) >= nbytes:
            return self._map
        size = os.fstat(self.fd).st_size
        if size < nbytes:
            if not grow:
                raise RuntimeError(f"slot {self.id} holds {size} bytes, a batch said {nbytes}")
            size = _round_up(nbytes + nbytes // 8, mmap.PAGESIZE)  # room for a slightly larger batch
            os.ftruncate(self.fd, size)
        # the old mapping (if any) is dropped, not closed: arrays still on it keep it alive
        self._map = mmap.mmap(self.fd, size)
        return self._map

    def close(self) -> None:
        """Close the descriptor (mappings, and arrays on them, stay valid until dropped)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._map = None


class SlotWriter:
    """Builds one batch in ``slot``: `alloc` (``collate``'s allocator) places arrays in the slot
    as they are stacked, so the batch is written once, where the parent will read it; `finish`
    lays the batch out, copying in only the arrays `alloc` did not make (the decoder's, or a
    batch transform's)."""

    def __init__(self, slot: Slot):
        self.slot, self.used = slot, 0
        self._placed: dict[int, tuple[np.ndarray, int]] = {}

    def _place(self, nbytes: int) -> tuple[mmap.mmap, int]:
        off = _round_up(self.used, ALIGN)
        self.used = off + nbytes
        # growing keeps what is written: the old mapping and the new one share the file's pages
        return self.slot.mapping(max(self.used, 1), grow=True), off

    def alloc(self, shape: tuple, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            return np.empty(shape, dtype)
        m, off = self._place(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        a = np.ndarray(shape, dtype, buffer=m, offset=off)
        self._placed[id(a)] = (a, off)
        return a

    def finish(self, batch: dict) -> tuple[SlotLayout, int]:
        """The layout of ``batch`` in the slot and the bytes it spans."""
        layout: SlotLayout = []
        for k, v in batch.items():
            if not isinstance(v, np.ndarray) or v.dtype.hasobject:
                layout.append((k, None, v, -1))
                continue
            placed = self._placed.get(id(v))
            if placed is not None and placed[0] is v:
                off = placed[1]
            else:  # the one copy of an array made elsewhere
                m, off = self._place(v.nbytes)
                np.copyto(np.ndarray(v.shape, v.dtype, buffer=m, offset=off), v, casting="no")
            layout.append((k, v.dtype, v.shape, off))
        self._placed.clear()
        return layout, self.used


def read_batch(slot: Slot, layout: SlotLayout, nbytes: int, release: Callable[[], None]) -> dict:
    """The batch ``layout`` describes, as views onto ``slot``; ``release`` is called once no
    array of it is referenced any more (at once when it has no array in the slot)."""
    if not nbytes:
        release()
        return {k: v for k, _, v, _ in layout}
    base = np.frombuffer(slot.mapping(nbytes), np.uint8, count=nbytes)
    weakref.finalize(base, release)
    out = {}
    for k, dtype, shape, off in layout:
        if dtype is None:
            out[k] = shape
            continue
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out[k] = base[off : off + n].view(dtype).reshape(shape)  # each view's .base is `base`
    return out


class SlotPool:
    """The parent's slots: `take` a free one (or a new one) for a batch to be built, `batch` the
    built batch's views (the slot comes back when they are gone), `release` one whose batch was
    abandoned. Thread-safe: a batch can be dropped in any thread. `close` closes every slot not
    under a live batch now, and the others when their batches go."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free: list[Slot] = []
        self._all: dict[int, Slot] = {}
        self._lent: set[int] = set()  # under a live batch
        self._closed = False

    def take(self) -> Slot:
        with self._lock:
            if self._free:
                return self._free.pop()
            slot = Slot.create(len(self._all))
            self._all[slot.id] = slot
            return slot

    def get(self, slot_id: int) -> Slot:
        return self._all[slot_id]

    def batch(self, slot_id: int, layout: SlotLayout, nbytes: int) -> dict:
        """The batch built in slot ``slot_id``, as views (see `read_batch`)."""
        with self._lock:
            self._lent.add(slot_id)
        return read_batch(self._all[slot_id], layout, nbytes, lambda: self.release(slot_id))

    def release(self, slot_id: int) -> None:
        with self._lock:
            self._lent.discard(slot_id)
            slot = self._all.get(slot_id)
            if slot is None or slot.fd < 0:
                return
            if self._closed:
                slot.close()
            else:
                self._free.append(slot)

    @property
    def lent(self) -> int:
        """Slots under live batches."""
        return len(self._lent)

    def __len__(self) -> int:
        return len(self._all)

    def close(self) -> None:
        """Close the free slots' descriptors now, the others' when their batches are released."""
        with self._lock:
            self._closed = True
            for slot in self._all.values():
                if slot.id not in self._lent:
                    slot.close()
            self._free.clear()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
