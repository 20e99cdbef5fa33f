"""A worker process of the process executor (`crossfeed.read.executors.processes`):
``python -m crossfeed.read.executors.worker FD``, FD its end of a Unix socket to the parent.

It receives the `WorkerRecipe` (JSON), builds its own `crossfeed.read.pipeline.Pipeline` from it (threads off: this process
is the parallelism), answers ``["ready", pid]``, then for each ``["build", gen, seq, slot]`` (the
sample ids in a blob) builds the batch in the slot (`crossfeed.read.executors.slots.SlotWriter`) and
answers with its layout and its stage times (`crossfeed.read.metrics.Meter.drain`) — or with the
exception's traceback. Nothing is pickled either way. A
thread reads the parent's messages as they come, so the parent's sends never wait on a busy worker. It exits when the parent closes the socket, when the
parent dies (its pid changes: reparented), or on SIGTERM.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback

import numpy as np


def _watch_parent(ppid: int) -> None:
    """Exit as soon as the parent is gone, even in the middle of a batch (no orphans)."""
    while os.getppid() == ppid:
        time.sleep(0.2)
    os._exit(1)


def _read_tasks(channel, tasks: queue.SimpleQueue) -> None:
    """Read the parent's messages as they come, each with its slot's fd when it brings one, so
    the parent's sends never wait on this worker's build (nor the two on each other's sends)."""
    known: set[int] = set()
    while True:
        try:
            msg, blobs = channel.recv()
        except (EOFError, OSError):
            tasks.put(None)
            return
        slot_id = msg[3]
        ids = np.frombuffer(blobs[0], dtype="<i8")
        tasks.put((msg, ids, None if slot_id in known else channel.fds.popleft()))
        known.add(slot_id)


def _pipeline(recipe):
    """This worker's own pipeline, built from the recipe (threads off: this process is the parallelism)."""
    from crossfeed.read.executors.threads import ExecutorKind
    from crossfeed.read.pipeline import Pipeline

    options = recipe.options.replace(executor=ExecutorKind.THREAD, num_threads=0)
    pipeline = Pipeline.build(
        recipe.source,
        options,
        transform=recipe.transform,
        batch_transform=recipe.batch_transform,
        filter=recipe.filter,
    )
    source = recipe.at_kept_versions(pipeline.datasets)
    if source is not None:  # appended to since the parent planned: its version is kept, open that one
        pipeline.close()
        pipeline = Pipeline.build(source, options, transform=recipe.transform, batch_transform=recipe.batch_transform)
    if recipe.transform_rng and not pipeline.recipe.rng:  # marked with_rng in the parent only
        pipeline.recipe.rng = True  # the builder's recipe
    if recipe.batch_transform_rng and not pipeline.recipe.batch_rng:
        pipeline.recipe.batch_rng = True
    recipe.check_versions(pipeline.datasets)
    return pipeline


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    from crossfeed.read.executors.processes import Channel, WorkerRecipe, exception_to_json, layout_to_json
    from crossfeed.read.executors.slots import Slot, SlotWriter

    channel = Channel(socket.socket(fileno=fd))
    try:
        (_, path, _index, recipe), _ = channel.recv()
        sys.path[:] = path
        pipeline = _pipeline(WorkerRecipe.from_json(recipe))
    except EOFError:
        return
    except BaseException as e:
        channel.send(["error", 0, -1, traceback.format_exc(), exception_to_json(e)])
        return
    channel.send(["ready", os.getpid()])
    tasks: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_tasks, args=(channel, tasks), daemon=True).start()
    slots: dict[int, Slot] = {}
    while True:
        task = tasks.get()
        if task is None:
            return
        (_, gen, seq, slot_id, *more), ids, fd = task
        if more:  # the epoch of the batch (each sample's generator is keyed by it)
            pipeline.set_epoch(int(more[0]))
        if len(more) > 1 and int(more[1]) >= 0:  # its global step (the batch transform's generator's key)
            from crossfeed.read.stages.recipes import tag

            ids = tag(ids, int(more[0]), int(more[1]))
        if fd is not None:
            slots[slot_id] = Slot(fd, slot_id)
        writer = SlotWriter(slots[slot_id])
        # the batch is made once, in the slot: stacked from the transform's samples, or else
        # decoded straight into it
        pipeline.set_allocator(writer.alloc)
        blobs: list = []
        try:
            layout, nbytes = writer.finish(pipeline.build_batch(ids))
            rows, blobs = layout_to_json(layout)
        except Exception as e:
            reply = ["error", gen, seq, traceback.format_exc(), exception_to_json(e)]
        else:
            skipped = pipeline.skipped
            # the batch's stage times (`crossfeed.read.metrics`) go back with it, and when it was done
            timed = pipeline.drain_meter()
            reply = ["done", gen, seq, slot_id, rows, nbytes, skipped, timed, time.perf_counter_ns(), pipeline.filtered]
        finally:
            pipeline.set_allocator(None)
        try:
            channel.send(reply, blobs)
        except OSError:
            return


if __name__ == "__main__":
    main(int(sys.argv[1]))
