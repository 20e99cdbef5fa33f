"""The pure parts of the network plane: addresses, control envelopes, dispatch bookkeeping,
watch statistics."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from crossfeed.errors import ConfigError, WireError
from crossfeed.net import protocol as P
from crossfeed.net.addresses import expand, expand_all
from crossfeed.net.observe import FieldStats, Rates, field_stats, image_grid
from crossfeed.net.stream.credits import CreditBook, Item

pytestmark = pytest.mark.timeout(30)


def test_brace_expansion():
    assert expand("tcp://127.0.0.1:78{80..83}") == [f"tcp://127.0.0.1:{p}" for p in range(7880, 7884)]
    assert expand("ipc:///tmp/{a,b}-{1..2}") == ["ipc:///tmp/a-1", "ipc:///tmp/a-2", "ipc:///tmp/b-1", "ipc:///tmp/b-2"]
    assert expand("x{03..1}") == ["x03", "x02", "x01"]
    assert expand("plain{}") == ["plain{}"]
    assert expand_all("tcp://h:{1,2} ipc://s") == ["tcp://h:1", "tcp://h:2", "ipc://s"]


@pytest.mark.parametrize("bad", ["localhost:80", "http://x:1", "tcp://nohost", "tcp://h:{1..99999}", ""])
def test_bad_addresses_are_config_errors(bad):
    with pytest.raises(ConfigError):
        expand_all(bad)


def test_envelopes_round_trip_and_reject_garbage():
    env = P.unpack(P.pack(P.Kind.ACK, 42, -1), P.CLIENT_KINDS)
    assert (env.kind, env.a, env.b) == (P.Kind.ACK, 42, -1)
    with pytest.raises(WireError, match="not expected"):
        P.unpack(P.pack(P.Kind.BATCH), P.CLIENT_KINDS)
    for junk in (b"", b"x" * 24, P.pack(P.Kind.ACK)[:-1]):
        with pytest.raises(WireError):
            P.unpack(junk, P.CLIENT_KINDS)
    with pytest.raises(ConfigError):
        P.Heartbeat(interval=2.0, timeout=1.0)


def test_acks_messages_round_trip_and_reject_garbage():
    frames = P.pack_acks([3, 9, 4])
    env = P.unpack(frames[0], P.CLIENT_KINDS)
    assert env.kind is P.Kind.ACKS and P.unpack_acks(env, frames[1]) == (3, 9, 4)
    with pytest.raises(WireError, match="ACKS declares"):
        P.unpack_acks(env, frames[1][:-1])
    with pytest.raises(WireError, match="ACKS declares"):
        P.unpack_acks(P.Envelope(P.Kind.ACKS, P.MAX_ACKS + 1), b"\0" * 8 * (P.MAX_ACKS + 1))
    with pytest.raises(ValueError):
        P.pack_acks([])


def test_recv_bounded_drains_an_oversized_message_and_keeps_the_socket_usable():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://bounded")
        b.connect("inproc://bounded")
        a.send_multipart([b"x"] * 10)
        a.send_multipart([b"ok"])
        assert b.poll(2000)
        with pytest.raises(WireError, match="limit"):
            P.recv_bounded(b, max_frames=3, max_bytes=100)
        assert b.poll(2000)
        assert [f.bytes for f in P.recv_bounded(b, max_frames=3, max_bytes=100)] == [b"ok"]
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def _items(n, epoch=0):
    return [Item(seq=i, epoch=epoch, frames=[], num_samples=1) for i in range(n)]


def test_dispatch_respects_credit_and_round_robins():
    d = CreditBook(max_credit=8, timeout=5.0)
    d.credit(b"a", 2, now=0.0)
    d.credit(b"b", 1, now=0.0)
    d.pending.extend(_items(5))
    assert d.demand() == 0
    got = [d.assign() for _ in range(4)]
    assert [(p, i.seq) for p, i in got[:3]] == [(b"a", 0), (b"b", 1), (b"a", 2)]
    assert got[3] is None  # everyone is full
    assert d.ack(b"b", 1).seq == 1 and d.ack(b"b", 1) is None
    assert d.assign()[0] == b"b"
    assert d.in_flight() == 4


def test_byte_credit_limits_what_is_in_flight_but_always_lets_one_batch_through():
    d = CreditBook(max_credit=64, timeout=5.0)
    d.credit(b"a", 10, now=0.0, nbytes=100)
    d.pending.extend(Item(seq=i, epoch=0, frames=[], num_samples=1, nbytes=60) for i in range(4))
    assert [d.assign()[1].seq for _ in range(2)] == [0, 1]  # 60 < 100, then 120: full
    assert d.assign() is None
    d.ack(b"a", 0)
    assert d.assign()[1].seq == 2 and d.assign() is None
    d.credit(b"a", 10, now=1.0, nbytes=10)  # smaller than one batch: still one at a time
    d.ack(b"a", 1)
    d.ack(b"a", 2)
    assert d.assign()[1].seq == 3 and d.peers[b"a"].unacked_bytes == 60


def test_a_dead_peers_batches_go_back_to_the_front_and_its_late_acks_are_ignored():
    d = CreditBook(max_credit=64, timeout=1.0)
    d.credit(b"slow", 10**9, now=0.0)  # clamped
    assert d.peers[b"slow"].credit == 64
    d.pending.extend(_items(3))
    for _ in range(2):
        d.assign()
    d.credit(b"fast", 4, now=0.5)
    assert d.expire(now=1.2) == [b"slow"]
    assert [i.seq for i in d.pending] == [0, 1, 2]
    assert d.ack(b"slow", 0) is None and not d.credit(b"slow", 1, now=2.0) and not d.seen(b"slow", 2.0)
    assert [d.assign()[1].seq for _ in range(3)] == [0, 1, 2]
    assert d.leave(b"fast") == 3 and [i.seq for i in d.pending] == [0, 1, 2]


def test_the_progress_deadline_fences_a_peer_that_holds_batches_and_acknowledges_none():
    d = CreditBook(max_credit=64, timeout=100.0, progress_timeout=1.0)
    d.credit(b"hung", 4, now=0.0)
    d.credit(b"idle", 4, now=0.0)
    d.pending.extend(_items(3))
    assert [d.assign(now=0.0)[0] for _ in range(3)] == [b"hung", b"idle", b"hung"]
    d.seen(b"idle", 0.8)
    assert d.ack(b"idle", 1) is not None  # its progress clock restarts at 0.8; it holds nothing now
    d.seen(b"hung", 0.9)  # heartbeats are not progress
    assert d.expire(now=0.95) == []
    assert d.expire(now=1.05) == [b"hung"] and [i.seq for i in d.pending] == [0, 2]
    assert d.expire(now=50.0) == []  # holding nothing, `idle` is never stuck


def test_batches_a_peer_skipped_were_lost_in_transit_and_go_out_again():
    d = CreditBook(max_credit=8, timeout=100.0)
    d.credit(b"a", 8, now=0.0)
    d.pending.extend(_items(4))
    assert [d.assign()[1].seq for _ in range(4)] == [0, 1, 2, 3]
    assert d.ack(b"a", 0).seq == 0 and not d.pending  # in order: nothing skipped
    assert d.ack(b"a", 2).seq == 2  # 1 was sent before 2 and never acknowledged: lost
    assert [i.seq for i in d.pending] == [1] and list(d.peers[b"a"].unacked) == [3]
    assert d.ack(b"a", 1) is None  # no longer this peer's


def test_a_peer_we_cannot_send_to_gets_nothing_more_until_it_speaks_but_is_not_declared_dead():
    d = CreditBook(max_credit=8, timeout=5.0)
    d.credit(b"a", 4, now=0.0)
    d.pending.extend(_items(2))
    peer, item = d.assign()
    d.unreachable(b"a", item)  # the send failed: not sent, back to the front
    assert [i.seq for i in d.pending] == [0, 1] and not d.peers[b"a"].unacked
    assert d.assign() is None and b"a" in d.peers and not d.is_dead(b"a")
    d.seen(b"a", 1.0)  # it reconnected and spoke
    assert d.assign()[1].seq == 0


def test_envelopes_carry_the_server_instance_and_the_probe_token():
    instance = P.new_instance()
    env = P.unpack(P.pack(P.Kind.FENCED, instance=instance, token=2**64 - 1), P.SERVER_KINDS)
    assert (env.kind, env.instance, env.token) == (P.Kind.FENCED, instance, 2**64 - 1)
    assert instance != P.new_instance() and instance != 0
    with pytest.raises(WireError, match="not expected"):
        P.unpack(P.pack(P.Kind.FENCED), P.CLIENT_KINDS)


def test_field_stats_and_rates():
    stats = field_stats([{"x": np.array([1.0, 3.0]), "t": ["ab", "c"]}, {"x": np.array([5.0, 7.0]), "t": ["d"]}])
    x = stats["x"]
    assert (x.min, x.max, x.mean) == (1.0, 7.0, 4.0) and x.std == pytest.approx(np.std([1, 3, 5, 7]))
    assert x.dtypes == {"float64"} and x.shapes == {()}  # the shape of one sample's value (no batch axis)
    assert stats["t"].max == 2 and stats["t"].shapes == {()} and stats["t"].of_lengths  # text: its lengths
    assert "min=1 max=7" in x.row("x")
    assert np.isnan(FieldStats().mean)
    r = Rates(start=0.0)
    r.add({"x": np.zeros((4, 10), np.uint8)})
    assert r.per_second(2.0) == (0.5, 2.0, 20 / 1e6)


def test_image_grid_lays_out_images_with_labels():
    imgs = np.zeros((10, 6, 5, 3), np.uint8)
    imgs[3] = 255
    grid = image_grid({"img": imgs, "label": np.arange(10)}, columns=4, tile=6)  # 6×6 tiles: 6×5 images fit as they are
    assert grid.size == (4 * 6, 3 * (6 + 14))
    pixels = np.asarray(grid)
    assert pixels[0:6, 18:23].min() == 255 and pixels[0:6, 0:18].max() == 0  # image 3: row 0, col 3
    assert pixels[6:20, 0:6].max() > 0  # a label is written under image 0
    with pytest.raises(ConfigError):
        image_grid({"label": np.arange(3)})


def test_a_lost_server_logs_a_loss_only_where_there_is_one(caplog):
    """Servers named directly: what one had not sent is lost to the client. A dispatcher's: its
    leases go to the other servers, and the log must not claim a loss (`Receiver.open_ended`)."""
    from crossfeed.net.stream.link import Link

    with caplog.at_level("WARNING", logger="crossfeed.net.stream.link"):
        Link(address="tcp://a:1", sock=None, started=0.0).lose("silent")
        Link(address="tcp://b:1", sock=None, started=0.0).lose("silent", leased=True)
    direct, leased = (r.getMessage() for r in caplog.records)
    assert "tcp://a:1" in direct and "is lost to this client" in direct
    assert "tcp://b:1" in leased and "lost to this client" not in leased and "nothing is lost" in leased
