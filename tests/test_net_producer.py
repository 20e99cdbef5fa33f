"""The server's producer: batches in order whoever builds them (its thread, or the server loop's
thread once builds are quick), a slow build handed back to a thread, failures and stops."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from crossfeed.format import wire
from crossfeed.net.stream import producer as PR
from crossfeed.net.stream.credits import Item

pytestmark = pytest.mark.timeout(60)


def _factory(batches: int, *, slow_at: int | None = None, fail_at: int | None = None, closed=None):
    """factory(epoch): `batches` batches of one array whose values say (epoch, batch); batch
    `slow_at` takes twice SLOW to build, batch `fail_at` raises; `closed` (a list) records each
    epoch whose iterator was closed."""

    def factory(epoch: int):
        try:
            for b in range(batches):
                if b == slow_at:
                    time.sleep(2 * PR.SLOW)
                if b == fail_at:
                    raise RuntimeError(f"batch {b} is broken")
                yield {"x": np.full(4, epoch * 1000 + b, np.int64)}
        finally:
            if closed is not None:
                closed.append(epoch)

    return factory


def _drain(producer: PR.Producer, timeout: float = 30.0) -> list:
    """Every message of the producer's queue, read as the server loop reads it (get_nowait)."""
    out: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = producer.queue.get_nowait()
        except queue.Empty:
            time.sleep(0.001)
            continue
        out.append(msg)
        if isinstance(msg, (PR.StreamEnd, PR.ProducerFailed)):
            return out
    raise AssertionError(f"the producer gave {len(out)} messages, then nothing for {timeout} s")


def _values(messages: list) -> list[int]:
    return [int(wire.decode(m.frames)[1]["x"][0]) for m in messages if isinstance(m, Item)]


def test_the_reader_builds_once_builds_are_quick_and_every_batch_comes_once_in_order():
    p = PR.Producer(_factory(40), server_id="s", epochs=2, inline=True).start()
    try:
        got = _drain(p)
    finally:
        p.stop()
    assert _values(got) == [e * 1000 + b for e in range(2) for b in range(40)]
    assert [m.seq for m in got if isinstance(m, Item)] == list(range(80))
    assert [m for m in got if not isinstance(m, Item)] == [PR.EpochEnd(0, 40), PR.EpochEnd(1, 40), PR.StreamEnd(2)]
    assert p.handovers >= 1  # the building moved to this (the reading) thread
    assert not p._thread.is_alive()


def test_a_slow_build_goes_back_to_a_thread_and_the_order_holds():
    slow_at = PR.INLINE_AFTER + 10  # built by the reader, inline
    p = PR.Producer(_factory(60, slow_at=slow_at), server_id="s", epochs=1, inline=True).start()
    try:
        got = _drain(p)
    finally:
        p.stop()
    assert _values(got) == list(range(60))
    assert got[-2:] == [PR.EpochEnd(0, 60), PR.StreamEnd(1)]
    assert p.handovers >= 3  # to the reader, back to a thread, to the reader again


def test_a_failure_while_the_reader_builds_is_reported_and_ends_the_stream():
    fail_at = PR.INLINE_AFTER + 5
    p = PR.Producer(_factory(30, fail_at=fail_at), server_id="s", epochs=1, inline=True).start()
    try:
        got = _drain(p)
    finally:
        p.stop()
    assert _values(got) == list(range(fail_at))
    assert isinstance(got[-1], PR.ProducerFailed) and f"batch {fail_at} is broken" in got[-1].message
    with pytest.raises(queue.Empty):
        p.queue.get_nowait()  # nothing follows


@pytest.mark.parametrize("inline", [False, True])
def test_stopping_mid_epoch_closes_the_factorys_iterator(inline):
    closed: list[int] = []
    p = PR.Producer(_factory(1000, closed=closed), server_id="s", epochs=None, inline=inline).start()
    got = [p.queue.get(timeout=5) for _ in range(3 * PR.INLINE_AFTER)]
    assert _values(got) == list(range(3 * PR.INLINE_AFTER))
    p.stop()
    assert closed == [0]
    assert not p._thread.is_alive()


def test_without_inline_the_thread_builds_everything():
    p = PR.Producer(_factory(40), server_id="s", epochs=1).start()
    try:
        got = _drain(p)
    finally:
        p.stop()
    assert _values(got) == list(range(40)) and p.handovers == 0
