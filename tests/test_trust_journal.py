"""Issue 22 items 13 and 3 (first half): the dispatcher's journal is checked, and never written
through a planted link.

Every single-bit flip of a small real journal is refused with a JournalError naming the damaged
line, or (a flip of the final newline, the record itself intact) replayed to exactly the state
the undamaged journal gives; every cut of its last append replays the records it holds whole;
records with a good checksum but bad fields are refused naming their line, never a raw
KeyError/IndexError/...; a planted `journal.tmp` link is refused, its target untouched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from dispatch_helpers import HB, ROOT, TESTS, write_dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from net_helpers import stop, wait_until

from crossfeed.errors import ConfigError, CrossfeedError, JournalError
from crossfeed.net.lease.dispatcher import DispatcherOptions, LeaseDispatcher, recover, replay
from crossfeed.net.lease.journal import encode

pytestmark = pytest.mark.timeout(120)

PLAN = {"batch_size": 4, "shuffle": True, "seed": 7}
BATCHES = 4
S1, T1, T2 = 11, 21, 22


def options(path, **kw) -> DispatcherOptions:
    return DispatcherOptions(f"ipc://{path.parent}/d.sock", path, epochs=2, lease_size=2, window=4, **kw)


def grant(book):
    return {b: tok for lease in book.grant_leases(0.0) for b, tok in zip(lease.batches, lease.tokens)}


def real_journal(path) -> list[int]:
    """A journal made as the dispatcher makes one: the plan, a claim and a done, a trainer
    declared dead (its claim goes out again), an epoch finished, half of the next one used.
    Returns the byte offset where each append began."""
    book, journal = recover(PLAN, BATCHES, options(path), 0.0)
    appends = []

    def flush():
        appends.append(path.stat().st_size)
        journal.append(book.take_records())

    book.server_seen(S1, 0.0, "tcp://127.0.0.1:1")
    book.trainer_seen(T1, 0.0)
    book.trainer_seen(T2, 0.0)
    lease = grant(book)
    assert book.claim(T1, 0, lease[0], now=0.0) and book.done(T1, 0, now=0.0) and book.claim(T2, 1, lease[1], now=0.0)
    flush()
    book.remove_trainer(T2, "declared dead")
    flush()
    lease.update(grant(book))  # batch 1 again, under a new lease
    for b in (1, 2, 3):
        assert book.claim(T1, b, lease[b], now=0.0) and book.done(T1, b, now=0.0)
    flush()
    assert book.epoch == 1
    lease = grant(book)
    assert book.claim(T1, 4, lease[0], now=0.0) and book.done(T1, 4, now=0.0) and book.claim(T1, 5, lease[1], now=0.0)
    flush()
    journal.close()
    return appends


def durable(path, compact: bool = True):
    """What a restarted dispatcher knows: its book's snapshot (and the claims' trainers); with
    `compact`, as `recover` leaves it (the journal rewritten), else as `replay` reads it."""
    if compact:
        book, journal = recover(PLAN, BATCHES, options(path), 0.0)
    else:
        book, journal, _ = replay(PLAN, BATCHES, options(path), 0.0)
    journal.close()
    return book.snapshot(), book.progress(), sorted(book.trainers)


def line_of(data: bytes, offset: int) -> int:
    """The 1-based line that byte `offset` belongs to (a newline belongs to the line it ends)."""
    return data.count(b"\n", 0, offset) + 1


def test_every_single_bit_flip_is_refused_naming_its_line_or_replays_exactly(tmp_path):
    """The dispatcher's own replay of each of the ~7,000 damaged journals (each flip made in
    place and undone: no file is rewritten, so the loop stays fast)."""
    path = tmp_path / "journal"
    real_journal(path)
    data = path.read_bytes()
    assert data.count(b"\n") >= 12 and len(data) < 1200
    want = durable(path, compact=False)
    assert want[1] == {"epoch": 1, "pending": 2, "leased": 0, "claimed": 1, "done": 1}
    kept = []
    fd = os.open(path, os.O_RDWR)
    try:
        for offset in range(len(data)):
            for bit in range(8):
                os.pwrite(fd, bytes([data[offset] ^ (1 << bit)]), offset)
                try:
                    got = durable(path, compact=False)
                except JournalError as e:
                    named = int(re.search(r" line (\d+) ", str(e)).group(1))
                    assert named == line_of(data, offset), (offset, bit, str(e))
                    assert "move it away" in str(e)
                    continue
                finally:
                    os.pwrite(fd, data[offset : offset + 1], offset)
                assert got == want, f"the flip of bit {bit} of byte {offset} changed the replayed state"
                kept.append(offset)
    finally:
        os.close(fd)
    assert kept == [len(data) - 1] * 8  # only the final newline: its record is intact


def test_every_cut_of_the_last_append_replays_the_records_it_holds_whole(tmp_path):
    path = tmp_path / "journal"
    appends = real_journal(path)
    data = path.read_bytes()
    ends = [i for i, c in enumerate(data) if c == ord("\n")]
    states = {}
    for cut in range(appends[-1], len(data) + 1):
        whole = sum(1 for e in ends if e <= cut)  # lines complete but perhaps for their newline
        if whole not in states:
            path.write_bytes(data[: ends[whole - 1] + 1])
            states[whole] = durable(path, compact=False)
        path.write_bytes(data[:cut])
        assert durable(path, compact=False) == states[whole], f"cut at byte {cut}"
    assert len(states) >= 3


def records(path) -> list[dict]:
    return [json.loads(line.split(b" ", 1)[1]) for line in path.read_bytes().splitlines()]


def rewrite(path, recs) -> None:
    path.write_bytes(b"".join(encode(r) for r in recs))


def _claim(b, token=1, trainer=T1, epoch=0):
    return {"t": "claim", "trainer": trainer, "epoch": epoch, "b": b, "token": token}


HEAD = [{"t": "epoch", "epoch": 0}]


@pytest.mark.parametrize(
    "body, line, match",
    [
        ([*HEAD, {"t": "done", "epoch": 0, "b": 0}], 3, "without being claimed"),
        ([*HEAD, _claim(BATCHES)], 3, "outside"),
        ([*HEAD, _claim(-1)], 3, "outside"),
        ([*HEAD, _claim(1, token=2**63)], 3, "63-bit token"),
        ([*HEAD, _claim(1, token=-1)], 3, "63-bit token"),
        ([*HEAD, _claim(1, trainer=0)], 3, "trainer id"),
        ([*HEAD, _claim(1, trainer=2**64)], 3, "trainer id"),
        ([*HEAD, _claim(True)], 3, "not an integer"),
        ([*HEAD, _claim(1.0)], 3, "not an integer"),
        ([*HEAD, _claim("1")], 3, "not an integer"),
        ([*HEAD, _claim(1, epoch=1)], 3, "epoch 1 in epoch 0"),
        ([*HEAD, _claim(1), _claim(1, trainer=T2)], 4, "claimed again"),
        ([*HEAD, {"t": "claim", "epoch": 0, "b": 1, "token": 1}], 3, "fields"),
        ([*HEAD, {**_claim(1), "extra": 1}], 3, "fields"),
        ([*HEAD, {"t": "epoch", "epoch": 1}], 3, "0 of 4 batches done"),
        ([*HEAD, {"t": "epoch", "epoch": 2**70}], 3, "outside"),
        ([*HEAD, {"t": "lease_ids", "below": 5}], 3, "unknown record kind"),
        ([*HEAD, {"t": "unclaim", "trainer": T1, "epoch": 1}], 3, "unclaim of epoch 1"),
        ([*HEAD, {"t": "bogus"}], 3, "unknown record kind"),
        ([_claim(1), HEAD[0]], 2, "start with"),
    ],
)
def test_records_with_a_good_checksum_and_bad_fields_are_refused_naming_the_line(tmp_path, body, line, match):
    path = tmp_path / "journal"
    real_journal(path)
    rewrite(path, [records(path)[0], *body])
    with pytest.raises(JournalError, match=f"line {line} .*{match}"):
        durable(path)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b'{"t":"epoch","epoch":0,"epoch":1}', "twice"),
        (b'{"t":"epoch","epoch":NaN}', "NaN"),
        (b'{"t":"epoch","epoch":' + b"9" * 5000 + b"}", "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON|object"),
        (b'["t"]', "object"),
    ],
)
def test_lines_that_are_not_one_strict_json_object_are_refused(tmp_path, raw, match):
    from crossfeed.format.tfrecord import masked_crc

    path = tmp_path / "journal"
    real_journal(path)
    plan = path.read_bytes().split(b"\n")[0] + b"\n"
    path.write_bytes(plan + b"%08x %s\n" % (masked_crc(raw), raw))
    with pytest.raises(JournalError, match=f"line 2 .*({match})"):
        durable(path)


VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, BATCHES, 2**63, 2**64, True, False, None, 1.5, "0", [], {}]),
)


_BASE: list[list[dict]] = []  # the real journal's records, made once


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_field_changed_under_a_good_checksum_is_refused_or_replays_without_a_raw_error(tmp_path_factory, data):
    if not _BASE:
        base = tmp_path_factory.mktemp("base") / "journal"
        real_journal(base)
        _BASE.append(records(base))
    path = tmp_path_factory.mktemp("j") / "journal"
    recs = json.loads(json.dumps(_BASE[0]))
    i = data.draw(st.integers(1, len(recs) - 1))
    key = data.draw(st.sampled_from(sorted(recs[i])))
    recs[i][key] = data.draw(VALUES | st.sampled_from(["epoch", "claim", "done", "unclaim", "lease_ids", "x"]))
    rewrite(path, recs)
    try:
        durable(path, compact=False)
    except JournalError as e:  # at that line, or at a later one it no longer agrees with
        assert int(re.search(r" line (\d+) ", str(e)).group(1)) >= i + 1, str(e)


def test_a_compacted_journal_keeps_its_plan_and_a_restart_continues(tmp_path):
    """The dispatcher compacts every `compact_after` lines as its loop does: the compacted file
    starts with the plan again, so a restart continues (it used to refuse "another plan")."""
    path = tmp_path / "journal"
    real_journal(path)
    want = durable(path)
    book, journal = recover(PLAN, BATCHES, options(path), 0.0)
    journal.compact(book.snapshot())  # the loop's call
    journal.close()
    assert durable(path) == want


def test_another_plans_journal_is_a_config_error(tmp_path):
    path = tmp_path / "journal"
    real_journal(path)
    with pytest.raises(ConfigError, match="another plan"):
        recover({**PLAN, "seed": 8}, BATCHES, options(path), 0.0)


# ---- item 3, first half: no link is followed ----
def test_a_planted_journal_tmp_link_is_refused_and_its_target_untouched(tmp_path):
    path = tmp_path / "journal"
    real_journal(path)
    before = path.read_bytes()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "journal.tmp").symlink_to(victim)
    with pytest.raises(JournalError, match="journal.tmp.*link"):
        LeaseDispatcher(PLAN, BATCHES, options(path))
    assert victim.read_bytes() == b"precious"
    assert not path.is_symlink() and path.read_bytes() == before


def test_a_leftover_journal_tmp_file_is_replaced(tmp_path):
    path = tmp_path / "journal"
    real_journal(path)
    want = durable(path)
    (tmp_path / "journal.tmp").write_bytes(b"half a compaction")
    d = LeaseDispatcher(PLAN, BATCHES, options(path))
    d.close()
    assert durable(path) == want and not (tmp_path / "journal.tmp").exists()


def test_a_journal_that_is_a_link_is_refused(tmp_path):
    real = tmp_path / "elsewhere"
    real_journal(real)
    before = real.read_bytes()
    path = tmp_path / "journal"
    path.symlink_to(real)
    with pytest.raises(JournalError, match="symbolic link"):
        LeaseDispatcher(PLAN, BATCHES, options(path))
    assert real.read_bytes() == before and path.is_symlink()


# ---- the real `crossfeed dispatch` process ----
def dispatch(tmp_path, dataset, name):
    ep = tmp_path / f"{name}.ep"
    argv = ["dispatch", dataset, f"ipc://{tmp_path}/{name}.sock", "--batch-size", "4"]
    argv += ["--journal", str(tmp_path / "journal"), *HB, "--endpoint-file", str(ep)]
    code = f"import dispatch_helpers; dispatch_helpers.cli(*{argv!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    with open(tmp_path / f"{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, ep


@pytest.mark.slow
def test_the_dispatch_command_stops_on_a_damaged_journal_and_on_a_planted_link(tmp_path):
    dataset = str(tmp_path / "ds")
    write_dataset(dataset, 40)
    first, ep = dispatch(tmp_path, dataset, "d1")
    try:
        wait_until(lambda: ep.exists(), 60, "the dispatcher's endpoint", [first])
    finally:
        stop(first)
    journal = tmp_path / "journal"
    good = journal.read_bytes()
    assert good.count(b"\n") == 2  # plan, epoch
    damaged = bytearray(good)
    damaged[good.index(b"\n") + 20] ^= 0x04  # in line 2
    journal.write_bytes(bytes(damaged))
    second, _ = dispatch(tmp_path, dataset, "d2")
    assert second.wait(60) != 0
    log = (tmp_path / "d2.log").read_text()
    assert re.search(r"journal .*journal line 2 \(byte \d+\): its checksum does not match", log), log[-2000:]
    journal.write_bytes(good)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "journal.tmp").symlink_to(victim)
    third, _ = dispatch(tmp_path, dataset, "d3")
    assert third.wait(60) != 0
    assert "journal.tmp is in the way" in (tmp_path / "d3.log").read_text()
    assert victim.read_bytes() == b"precious" and not journal.is_symlink()


def test_journal_error_is_a_crossfeed_error():
    assert issubclass(JournalError, CrossfeedError)


def test_a_fifo_at_the_journal_path_is_refused_at_once_and_sigterm_stops_a_waiting_dispatcher(tmp_path):
    """A FIFO planted at the journal path (whose open() would wait for a writer forever) is
    refused by name without blocking; with a regular journal, a dispatcher waiting for servers
    stops on SIGTERM (bounded waits: a hang fails the test, the time is not measured)."""
    import signal

    dataset = str(tmp_path / "ds")
    write_dataset(dataset, 40)
    journal = tmp_path / "journal"
    os.mkfifo(journal)
    blocked, _ = dispatch(tmp_path, dataset, "fifo")
    try:
        assert blocked.wait(60) != 0
    finally:
        stop(blocked)
    log = (tmp_path / "fifo.log").read_text()
    assert f"journal {journal} is not a regular file (a FIFO)" in log, log[-2000:]
    assert "Traceback" not in log, log[-2000:]
    journal.unlink()
    waiting, ep = dispatch(tmp_path, dataset, "d")
    try:
        wait_until(lambda: ep.exists(), 60, "the dispatcher's endpoint", [waiting])
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(30) == 0, (tmp_path / "d.log").read_text()[-2000:]
    finally:
        stop(waiting)
