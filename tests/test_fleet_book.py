"""Mixed-speed servers in the lease book, on a simulated clock (no sockets): leases sized from
measured rates, a slow server's unstarted work and a stalled server's work taken over by a
faster one, every batch granted once."""

from __future__ import annotations

import collections

import pytest

from crossfeed.net.lease import messages as W
from crossfeed.net.lease.book import LeaseBook

FAST, SLOW, T = 11, 12, 21


def _run(book: LeaseBook, rates: dict[int, float], seconds: float, *, report: bool = True, dt: float = 0.01):
    """Servers build their leased batches in order at `rates` (batches/s; 0: stalled, beating),
    one trainer claims and uses each at once; returns (batch -> times used, server -> batches
    whose claim was granted, refused copies, the simulated seconds it ran)."""
    queues = {k: collections.deque() for k in rates}
    credit = dict.fromkeys(rates, 0.0)
    used, by, refused = collections.Counter(), collections.Counter(), 0
    for k in rates:
        book.server_seen(k, 0.0, address=f"tcp://h:{k}")
    for i in range(int(seconds / dt)):
        now = i * dt
        book.trainer_seen(T, now)
        for k in rates:
            book.server_seen(k, now)
            if report:
                book.server_progress(k, max(len(queues[k]) - 1, 0), now)
        for lease in book.grant_leases(now):
            queues[lease.server].extend(
                (lease.epoch * book.batches + b, t) for b, t in zip(lease.batches, lease.tokens)
            )
        if report:  # a server that reports its unstarted batches is told which were taken back (TAKEN)
            for k, leases in book.take_taken().items():
                gone = {book.epoch * book.batches + b for batches in leases.values() for b in batches}
                queues[k] = collections.deque(x for x in queues[k] if x[0] not in gone)
        book.expire(now)
        for k, rate in rates.items():
            credit[k] = credit[k] + rate * dt if queues[k] else 0.0
            while credit[k] >= 1 and queues[k]:
                credit[k] -= 1
                seq, token = queues[k].popleft()
                if book.claim(T, seq, token, now=now):
                    used[seq] += 1
                    by[k] += 1
                    assert book.done(T, seq, now=now)
                else:
                    refused += 1
        if book.finished:
            break
    return used, by, refused, now


def test_a_fast_server_takes_over_a_slow_ones_unstarted_tail_and_each_batch_is_used_once():
    book = LeaseBook(200, epochs=3, lease_size=8, window=64, lease_timeout=120.0)
    used, by, refused, _ = _run(book, {FAST: 400.0, SLOW: 10.0}, 10.0)
    assert book.finished and sorted(used) == list(range(600)) and set(used.values()) == {1}
    # the fast one alone: 1.5 s; before rates and taking over, the slow one held 64 batches of each
    # epoch (6.4 s of its work per epoch, 19 s in all)
    assert book.counts["batches_taken_over"] > 0 and by[FAST] > 10 * by[SLOW], (by, book.counts)
    assert refused <= book.counts["batches_taken_over"]


def test_a_straggler_told_what_was_taken_back_keeps_building_its_own_at_its_rate():
    """A straggler (1/18 of the fastest) over-leased before its rate was known gives its unstarted
    excess back and is told which batches (TAKEN): it builds none of them (it used to build them
    all, each refused, and delivered a third of its rate)."""
    book = LeaseBook(2000, epochs=1, lease_size=8, window=64, lease_timeout=120.0)
    used, by, refused, _ = _run(book, {FAST: 108.0, SLOW: 75.0, 13: 6.0}, 12.0)
    assert book.counts["batches_taken_over"] > 0 and refused == 0
    assert by[13] >= 0.8 * 6.0 * 12.0, by
    assert set(used.values()) == {1}


def test_a_slow_server_holds_a_few_batches_and_a_fast_one_many():
    book = LeaseBook(100_000, epochs=1, lease_size=8, window=64)
    _run(book, {FAST: 400.0, SLOW: 10.0}, 3.0)
    assert book.outstanding(SLOW) <= 8 < book.outstanding(FAST), (book.outstanding(SLOW), book.outstanding(FAST))
    assert book.rate(FAST, 3.0) > 20 * book.rate(SLOW, 3.0)


@pytest.mark.parametrize("report", [True, False], ids=["reports", "older server"])
def test_a_stalled_server_s_work_is_taken_over_in_seconds_not_at_the_lease_timeout(report):
    book = LeaseBook(100, epochs=2, lease_size=8, window=64, lease_timeout=120.0)
    used, by, _, _ = _run(book, {0x5: 0.0, FAST: 200.0}, 20.0, report=report)
    assert book.finished and sorted(used) == list(range(200)), "an epoch waited for the stalled server"
    assert by[FAST] == 200 and book.counts["servers_lost"] == 0  # carried, not removed at the timeout


@pytest.mark.parametrize("report", [True, False], ids=["reports", "older server"])
def test_a_stalled_server_costs_short_epochs_little_not_a_grace_period_each(report):
    """Epochs of half a second: a server that stalls (beats on, builds nothing) is judged once;
    in later epochs it gets at most one batch, taken over at once at the tail (it used to get two
    at each epoch's start and hold each epoch's end for a second)."""
    alone = _run(LeaseBook(100, epochs=10, lease_size=8, window=64), {FAST: 200.0}, 60.0)[3]
    book = LeaseBook(100, epochs=10, lease_size=8, window=64, lease_timeout=120.0)
    used, by, _, took = _run(book, {0x5: 0.0, FAST: 200.0}, 60.0, report=report)
    assert book.finished and sorted(used) == list(range(1000)) and by[FAST] == 1000
    assert took < alone + 2.0, (took, alone)  # one grace period (1 s), not one per epoch


def test_between_servers_of_one_speed_no_started_batch_is_taken_over():
    book = LeaseBook(300, epochs=2, lease_size=8, window=64)
    used, _, refused, _ = _run(book, {FAST: 200.0, SLOW: 190.0}, 10.0)
    assert book.finished and set(used.values()) == {1} and len(used) == 600
    assert refused == 0 and book.counts["batches_taken_over"] == 0


def test_a_servers_unstarted_count_travels_in_its_beat_and_a_negative_one_is_refused():
    (frame,) = W.pack(W.Kind.BEAT, role=1, sender=7, unstarted=W.encode_unstarted(5))
    msg = W.unpack([frame], W.SERVER_KINDS)
    assert W.decode_unstarted(msg.sent_ms) == 5 and msg.wait_permille == 0
    assert W.decode_unstarted(0) is None  # an older server: not reported
    with pytest.raises(Exception, match="unstarted"):
        W.decode_unstarted(-3)
