"""The dispatcher's lease bookkeeping and journal, without sockets."""

from __future__ import annotations

import pytest

from crossfeed.errors import ConfigError, JournalError, WireError
from crossfeed.net.lease import messages as W
from crossfeed.net.lease.book import LeaseBook
from crossfeed.net.lease.journal import Journal, encode

S1, S2, T1, T2 = 11, 12, 21, 22


def tok(lease, b: int) -> int:
    """The claim token `lease` gave batch number `b` (what its server sends with the batch)."""
    return lease.tokens[lease.batches.index(b)]


def run_epoch(book: LeaseBook, epochs: int = 1) -> list[int]:
    """Lease, claim and finish `epochs` epochs with server S1 and trainer T1; the seqs used."""
    used = []
    end = book.epoch + epochs
    while not book.finished and book.epoch < end:
        leases = book.grant_leases(0.0)
        if not leases:
            break
        for lease in leases:
            for b in lease.batches:
                seq = lease.epoch * book.batches + b
                assert book.claim(T1, seq, tok(lease, b), now=0.0)
                assert book.done(T1, seq, now=0.0)
                used.append(seq)
    return used


def test_every_batch_once_over_epochs():
    book = LeaseBook(10, epochs=2, lease_size=3, window=6)
    book.server_seen(S1, 0.0, "tcp://a:1")
    book.trainer_seen(T1, 0.0)
    assert run_epoch(book, 2) == list(range(20))
    assert book.finished


def test_a_dead_servers_unclaimed_batches_go_to_the_other_and_claims_under_its_lease_are_refused():
    book = LeaseBook(12, epochs=1, lease_size=2, window=4)
    book.server_seen(S1, 0.0, "a")
    book.trainer_seen(T1, 0.0)
    leases = book.grant_leases(0.0)
    assert [lease.server for lease in leases] == [S1, S1]
    first = leases[0]
    assert book.claim(T1, first.batches[0], tok(first, first.batches[0]), now=0.0)
    assert book.done(T1, first.batches[0], now=0.0)
    assert book.claim(
        T1, first.batches[1], tok(first, first.batches[1]), now=0.0
    )  # claimed, not consumed: stays with T1
    book.server_seen(S2, 1.0, "b")
    book.trainer_seen(T1, 10.5)
    book.server_seen(S2, 10.5)
    servers, trainers = book.expire(10.5)
    assert servers == [S1] and trainers == []
    # S1 wakes up and sends its second lease: fenced
    assert not book.claim(T1, leases[1].batches[0], tok(leases[1], leases[1].batches[0]), now=0.0)
    assert not book.server_seen(S1, 12.0)
    again = book.grant_leases(0.0)
    assert {lease.server for lease in again} == {S2}
    reissued = sorted(b for lease in again for b in lease.batches)
    assert first.batches[0] not in reissued and first.batches[1] not in reissued
    assert leases[1].batches[0] in reissued
    assert book.done(T1, first.batches[1], now=0.0)


def test_a_dead_trainers_claims_go_out_again_and_it_is_fenced():
    book = LeaseBook(4, epochs=1, lease_size=4, window=8, timeout=1.0)
    book.server_seen(S1, 0.0, "a")
    book.trainer_seen(T1, 0.0)
    book.trainer_seen(T2, 0.0)
    (lease,) = book.grant_leases(0.0)
    assert book.claim(T1, 0, tok(lease, 0), now=0.0) and book.claim(T1, 1, tok(lease, 1), now=0.0)
    assert not book.claim(T2, 0, tok(lease, 0), now=0.0)  # the same batch again: refused
    assert book.claim(T1, 0, tok(lease, 0), now=0.0)  # a repeated claim (lost answer) by the holder: granted
    book.server_seen(S1, 2.0)
    book.trainer_seen(T2, 2.0)
    assert book.expire(2.5) == ([], [T1])
    assert not book.trainer_seen(T1, 3.0) and not book.done(T1, 0, now=0.0)
    assert book.outstanding(S1) == 2
    (again,) = book.grant_leases(0.0)
    assert again.batches == [0, 1]


def test_the_window_bounds_what_one_server_holds_and_a_new_server_gets_work_at_once():
    book = LeaseBook(100, epochs=1, lease_size=4, window=8)
    book.server_seen(S1, 0.0, "a")
    assert sum(len(x.batches) for x in book.grant_leases(0.0)) == 8
    assert book.grant_leases(0.0) == []
    book.server_seen(S2, 0.0, "b")
    assert sum(len(x.batches) for x in book.grant_leases(0.0) if x.server == S2) == 8


def test_malformed_claims_are_refused():
    book = LeaseBook(4, epochs=1)
    book.server_seen(S1, 0.0, "a")
    book.trainer_seen(T1, 0.0)
    (lease,) = book.grant_leases(0.0)
    good = tok(lease, 0)
    for seq, token in [(-1, good), (4, good), (1 << 62, good), (0, 0), (0, good + 1), (0, -5), (0, lease.id)]:
        assert not book.claim(T1, seq, token, now=0.0)
    assert not book.claim(999, 0, tok(lease, 0), now=0.0)  # an unknown trainer
    assert not book.done(T1, 0, now=0.0)  # never claimed


def test_journal_replay_continues_the_epoch(tmp_path):
    journal = Journal(tmp_path / "j.jsonl")
    book = LeaseBook(6, epochs=2, lease_size=2, window=6)
    book.server_seen(S1, 0.0, "a")
    book.trainer_seen(T1, 0.0)
    run_epoch(book)  # epoch 0
    leases = book.grant_leases(0.0)
    assert book.claim(T1, 6 + leases[0].batches[0], tok(leases[0], leases[0].batches[0]), now=0.0)
    assert book.done(T1, 6 + leases[0].batches[0], now=0.0)
    assert book.claim(T1, 6 + leases[0].batches[1], tok(leases[0], leases[0].batches[1]), now=0.0)
    journal.append(book.take_records())
    with open(journal.path, "ab") as f:
        f.write(b'{"t": "done", "ep')  # torn by a crash
    again = LeaseBook(6, epochs=2, lease_size=2, window=6)
    again.restore(Journal(journal.path).read(), now=100.0)
    assert again.epoch == 1
    assert again.progress() == {"epoch": 1, "pending": 4, "leased": 0, "claimed": 1, "done": 1}
    assert T1 in again.trainers  # it has `timeout` to come back
    again.server_seen(S2, 100.0, "b")
    new = again.grant_leases(100.0)
    assert not {t for x in new for t in x.tokens} & {t for x in leases for t in x.tokens}  # old ones stay revoked
    assert not again.claim(T1, 6 + leases[1].batches[0], tok(leases[1], leases[1].batches[0]), now=0.0)
    assert again.done(T1, 6 + leases[0].batches[1], now=0.0)
    # compaction keeps the same durable state
    j2 = Journal(tmp_path / "k.jsonl")
    j2.compact(again.snapshot())
    third = LeaseBook(6, epochs=2, lease_size=2, window=6)
    third.restore(j2.read(), now=0.0)
    assert third.progress() == again.progress() | {"leased": 0, "pending": 4}


def test_a_corrupt_journal_line_is_named(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(encode({"t": "epoch", "epoch": 1}) + b"xx\n" + encode({"t": "epoch", "epoch": 2}))
    with pytest.raises(JournalError, match="line 2"):
        Journal(path).read()


def test_options_are_checked():
    with pytest.raises(ConfigError):
        LeaseBook(0, epochs=1)
    with pytest.raises(ConfigError):
        LeaseBook(3, epochs=1, lease_size=4, window=2)


def test_a_quota_gives_each_trainer_an_equal_count_and_refused_copies_go_out_again():
    book = LeaseBook(4, epochs=2, lease_size=4, window=8, quota=2)
    book.server_seen(S1, 0.0, "a")
    book.trainer_seen(T1, 0.0)
    book.trainer_seen(T2, 0.0)
    (lease,) = book.grant_leases(0.0)
    assert book.claim(T1, 0, tok(lease, 0), now=0.0) and book.claim(T1, 1, tok(lease, 1), now=0.0)
    assert not book.claim(T1, 2, tok(lease, 2), now=0.0)  # T1 has its two: batch 2 goes out again
    assert book.progress()["pending"] == 1
    (again,) = book.grant_leases(0.0)
    assert again.batches == [2]
    assert book.claim(T2, 2, tok(again, 2), now=0.0) and book.claim(T2, 3, tok(lease, 3), now=0.0)
    for t, seq in [(T1, 0), (T1, 1), (T2, 2), (T2, 3)]:
        assert book.done(t, seq, now=0.0)
    assert book.epoch == 1  # the quota counts per epoch
    (lease,) = book.grant_leases(0.0)
    assert book.claim(T1, 4, tok(lease, 0), now=0.0) and book.claim(T1, 5, tok(lease, 1), now=0.0)


def test_a_copy_refused_to_an_unknown_trainer_goes_out_again():
    book = LeaseBook(2, epochs=1, lease_size=2, window=2)
    book.server_seen(S1, 0.0, "a")
    (lease,) = book.grant_leases(0.0)
    assert not book.claim(T1, 0, tok(lease, 0), now=0.0)  # T1 never beat: unknown
    assert book.progress()["pending"] == 1


def test_leasewire_round_trips_and_refuses_what_is_malformed():
    frames = W.pack(W.Kind.CLAIM, sender=5, payload=[(1, 2), (3, 4)])
    msg = W.unpack(frames, W.TRAINER_KINDS)
    assert msg.kind is W.Kind.CLAIM and msg.sender == 5 and msg.payload.tolist() == [[1, 2], [3, 4]]
    hello = W.unpack(W.pack(W.Kind.HELLO, sender=1, payload="tcp://h:1 ipc:///x"), W.SERVER_KINDS)
    assert W.endpoints(hello.payload) == ["tcp://h:1", "ipc:///x"]
    env = frames[0]
    bad = [
        [],
        [b"short"],
        [b"XXXX" + env[4:]],
        [env[:4] + b"\x09" + env[5:], frames[1]],  # another version
        [env],  # CLAIM without its payload
        [env, b"1234567"],  # not whole pairs
        [env, b"\0" * (16 * (W.MAX_ITEMS + 1))],  # too many
        W.pack(W.Kind.LEASE, payload=[1]),  # a dispatcher's kind, from a trainer
        [W.pack(W.Kind.HELLO, sender=1)[0], b"\xff"],  # not UTF-8
    ]
    for frames in bad:
        with pytest.raises(WireError):
            W.unpack(frames, W.TRAINER_KINDS | W.SERVER_KINDS)
    for text in ["", "http://x", "tcp://" + "a" * 300, " ".join(["ipc:///a"] * 17), "tcp://a\x00"]:
        with pytest.raises(WireError):
            W.endpoints(text)


def test_a_beat_carries_a_trainers_wait_share_and_refuses_one_out_of_range():
    import struct

    assert [W.encode_wait(x) for x in (None, float("nan"), 0.0, 0.3804, 1.0, 7.0, -1.0)] == [
        0,
        0,
        1,
        381,
        1001,
        1001,
        1,
    ]
    assert [W.decode_wait(v) for v in (0, 1, 381, W.WAIT_END)] == [None, 0.0, 0.38, 1.0]
    msg = W.unpack(W.pack(W.Kind.BEAT, role=2, sender=5, sent_ms=9, wait_permille=381), W.TRAINER_KINDS)
    assert (msg.sent_ms, msg.wait_permille, msg.role) == (9, 381, 2)
    assert W.unpack(W.pack(W.Kind.BEAT, role=2, sender=5), W.TRAINER_KINDS).wait_permille == 0  # an older trainer's

    def env(kind: W.Kind, b: int) -> bytes:  # slot b set, a = 9, c (role) = 2, sender 5
        return struct.pack("<4sBBHqqqQQ", W.MAGIC, W.VERSION, int(kind), 0, 9, b, 2, 5, 0)

    assert W.unpack([env(W.Kind.BEAT, W.WAIT_END)], W.TRAINER_KINDS).wait_permille == W.WAIT_END
    for b in (W.WAIT_END + 1, -1, 1 << 62):
        with pytest.raises(WireError, match="wait_permille"):
            W.unpack([env(W.Kind.BEAT, b)], W.TRAINER_KINDS)
    with pytest.raises(WireError, match="does not use"):  # slot b of another kind stays unused
        W.unpack([env(W.Kind.BYE, 5)], W.TRAINER_KINDS)


def test_a_server_that_beats_but_delivers_nothing_is_stalled_and_fenced():
    book = LeaseBook(8, epochs=1, lease_size=2, window=4, timeout=100.0, lease_timeout=5.0)
    book.server_seen(S1, 0.0, "a")
    book.trainer_seen(T1, 0.0)
    leases = book.grant_leases(0.0)
    assert book.claim(T1, leases[0].batches[0], tok(leases[0], leases[0].batches[0]), now=4.0)  # progress at 4
    assert book.expire(8.9) == ([], [])
    assert book.expire(9.1) == ([S1], [])  # nothing reached a trainer since 4
    assert not book.server_seen(S1, 9.2)  # fenced: it must rejoin under a new id
    b = leases[1].batches[0]
    assert not book.claim(T1, b, tok(leases[1], b), now=9.2)  # what it still sends is refused
    book.server_seen(S2, 9.2, "b")
    again = book.grant_leases(9.2)
    assert b in {x for lease in again for x in lease.batches}


def test_a_lease_overtaken_by_a_later_one_is_leased_again_its_server_kept():
    """A batch stuck unclaimed (at a trainer whose loop hangs) while its server goes on."""
    book = LeaseBook(8, epochs=1, lease_size=2, window=4, timeout=100.0, lease_timeout=5.0)
    book.server_seen(S1, 0.0, "a")
    book.trainer_seen(T1, 0.0)
    first, second = book.grant_leases(0.0)
    assert book.claim(T1, first.batches[0], tok(first, first.batches[0]), now=1.0)
    assert book.claim(T1, second.batches[0], tok(second, second.batches[0]), now=2.0)  # overtakes `first`
    book.server_seen(S1, 7.0)
    book.trainer_seen(T1, 7.0)
    assert book.claim(T1, second.batches[1], tok(second, second.batches[1]), now=7.0)  # S1 keeps delivering
    assert book.expire(7.1) == ([], [])
    stuck = first.batches[1]
    assert book.state[stuck] == 0 and S1 in book.servers  # PENDING again; S1 not fenced
    assert not book.claim(T1, stuck, tok(first, stuck), now=7.2)  # the stuck copy is refused
    (again,) = [x for x in book.grant_leases(7.2) if stuck in x.batches]
    assert book.claim(T1, stuck, tok(again, stuck), now=7.3)


def test_a_trainer_that_holds_claims_and_reports_none_done_is_stalled_and_fenced():
    book = LeaseBook(4, epochs=1, lease_size=4, window=4, timeout=100.0, claim_timeout=5.0)
    book.server_seen(S1, 0.0, "a")
    book.trainer_seen(T1, 0.0)
    (lease,) = book.grant_leases(0.0)
    for b in (0, 1, 2):
        assert book.claim(T1, b, tok(lease, b), now=1.0)
    assert book.done(T1, 0, now=3.0)  # progress at 3
    assert book.expire(7.9) == ([], [])
    assert book.expire(8.1) == ([], [T1])
    assert book.progress() == {"epoch": 0, "pending": 2, "leased": 1, "claimed": 0, "done": 1}
    assert not book.trainer_seen(T1, 8.2) and not book.done(T1, 1, now=8.2)


def test_lease_ids_and_claim_tokens_are_random_and_a_re_lease_draws_new_tokens():
    book = LeaseBook(64, epochs=1, lease_size=8, window=64)
    first = [31, 32, 33, 34]  # a server not yet measured gets two leases
    for k in first:
        book.server_seen(k, 0.0, "a")
    leases = book.grant_leases(0.0)
    ids = [x.id for x in leases]
    tokens = [t for x in leases for t in x.tokens]
    # (the epoch's tail goes out in leases of one batch: more than 8 leases)
    assert len(tokens) == 64 and len(ids) >= 8
    assert len(set(ids + tokens)) == len(ids) + 64 and min(ids + tokens) > 0 and max(ids + tokens) < 1 << 63
    assert sorted(ids) != list(range(min(ids), min(ids) + len(ids)))  # not counted
    for k in first:
        book.remove_server(k, "left")
    book.server_seen(S2, 0.0, "b")
    again = book.grant_leases(0.0)
    assert not {t for x in again for t in x.tokens} & set(tokens)


def test_a_count_of_its_own_each_epoch_in_the_book_and_the_journal(tmp_path):
    """Packed plans: epoch e has counts(e) batches, global ids keep the stride (`batches`); the
    journal checks each epoch's records against its own count and a restart continues."""
    counts = {0: 3, 1: 5, 2: 2}.__getitem__
    plan = {"t": "plan", "batches": 100, "epochs": 3}
    book = LeaseBook(100, epochs=3, lease_size=2, window=4, counts=counts)
    book.server_seen(S1, 0.0, "a")
    book.trainer_seen(T1, 0.0)
    journal = Journal(tmp_path / "j", plan=plan, counts=counts)
    journal.compact(book.snapshot())
    assert run_epoch(book) == [0, 1, 2] and book.epoch == 1 and book.n == 5
    leases = book.grant_leases(0.0)
    assert [b for x in leases for b in x.batches] == [0, 1, 2, 3]
    for b in (0, 1):
        assert book.claim(T1, 100 + b, tok(leases[0], b), now=0.0) and book.done(T1, 100 + b, now=0.0)
    assert not book.claim(T1, 100 + 5, 1, now=0.0)  # past epoch 1's count
    journal.append(book.take_records())
    again = LeaseBook(100, epochs=3, lease_size=2, window=4, counts=counts)
    again.restore(Journal(journal.path, plan=plan, counts=counts).read(), now=0.0)
    assert again.progress() == {"epoch": 1, "pending": 3, "leased": 0, "claimed": 0, "done": 2}
    again.server_seen(S1, 0.0, "a")
    again.trainer_seen(T1, 0.0)
    assert sorted(run_epoch(again, 2)) == [102, 103, 104, 200, 201] and again.finished
    with pytest.raises(JournalError, match="with 3 of 100 batches done"):  # read as one count for all epochs
        Journal(journal.path, plan=plan).read()
    with open(journal.path, "ab") as f:
        f.write(encode({"t": "claim", "trainer": T1, "epoch": 1, "b": 5, "token": 7}))
    with pytest.raises(JournalError, match="batch 5 is outside 0..4"):
        Journal(journal.path, plan=plan, counts=counts).read()


def test_epoch_counts_walk_each_epoch_once_the_next_ahead_and_none_past_the_last():
    from crossfeed.net.lease.dispatcher import EpochCounts

    walked = []

    def count(e: int) -> int:
        walked.append(e)
        return 10 + e

    counts = EpochCounts(count, epochs=2)
    assert counts(0) == 10 and counts(1) == 11 and counts(0) == 10 and counts(1) == 11
    assert sorted(walked) == [0, 1]  # 1 walked ahead (once), 2 never: past the last epoch
