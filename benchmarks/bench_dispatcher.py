"""The dispatcher's capacity: one process's claims, dones and leases per second, and a fleet simulation.

    python benchmarks/bench_dispatcher.py process [--servers 32] [--trainers 64] [--seconds 10]
    python benchmarks/bench_dispatcher.py simulate [--servers 1000] [--trainers 4096] [--seconds 60]

`process`: a real `LeaseDispatcher` (journal on, on this machine's disk) in a child process,
driven over loopback tcp by one load process that plays `--servers` servers (HELLO, BEAT with
their unstarted batches, LEASEs received) and `--trainers` trainers (each keeps `--inflight`
batches claimed and not yet answered: CLAIM one batch, on its grant DONE it, claim the next).
Prints grants, dones and leases per second and the claim latency a trainer sees (send of the
CLAIM to its GRANTS, p50/p99/max). The dispatcher journals each loop pass's records with one
write and one fsync before it answers (group commit), so the rate at which fsync returns
bounds passes, not claims.

`simulate`: the real `LeaseBook` and `Journal` (appends with fsync, compaction) on a simulated
clock, no sockets: servers with lognormal rates, stragglers at 1/20th of their rate, servers
that stall (alive, beating, building nothing), deaths (silent: declared dead after the
heartbeat timeout) and joins; trainers with their own rates and two batches of credit each, fed
round robin. Checks every batch of every epoch was granted once and used once, and prints the
fleet's delivered share of its capacity, the servers' fair shares (claims against rate x time
alive), the trainers' spread, the stalled servers' work carried, the journal's largest size,
and the wall time the book and journal spent per claim (the dispatcher's cost per batch).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ---- process: a real dispatcher over loopback ----
def _dispatcher_main(journal: str, batches: int, ready, stop) -> None:
    from crossfeed.net.lease.dispatcher import DispatcherOptions, LeaseDispatcher

    options = DispatcherOptions("tcp://127.0.0.1:0", Path(journal), epochs=None)
    with LeaseDispatcher({"split": "train", "batch_size": 1}, batches, options) as d:
        ready.put(d.endpoint)
        stop.wait()
        ready.put(json.dumps(d.stats))


def process(args) -> None:
    import logging

    import zmq

    from crossfeed.net import protocol as P
    from crossfeed.net.lease import messages as W

    logging.getLogger("crossfeed").setLevel(logging.ERROR)
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryDirectory() as tmp:
        child = ctx.Process(target=_dispatcher_main, args=(str(Path(tmp) / "journal"), args.batches, ready, stop))
        child.start()
        endpoint = ready.get(timeout=60)
        zctx = zmq.Context()
        zctx.set(zmq.MAX_SOCKETS, 2 * (args.servers + args.trainers) + 64)
        poller = zmq.Poller()
        servers, trainers = {}, {}
        for _ in range(args.servers):
            s = zctx.socket(zmq.DEALER)
            s.connect(endpoint)
            sid = P.new_instance()
            s.send_multipart(W.pack(W.Kind.HELLO, role=1, sender=sid, payload=f"tcp://127.0.0.1:{1000 + len(servers)}"))
            servers[s] = sid
            poller.register(s, zmq.POLLIN)
        for _ in range(args.trainers):
            t = zctx.socket(zmq.DEALER)
            t.connect(endpoint)
            trainers[t] = P.new_instance()
            poller.register(t, zmq.POLLIN)
        ready_batches: collections.deque = collections.deque()  # (seq, token) built by "servers"
        sent: dict[tuple, float] = {}  # (trainer socket, seq) -> when its CLAIM left
        inflight = collections.Counter()
        lat: list[float] = []
        counts = collections.Counter()
        start = time.perf_counter()
        next_beat, measure_from = 0.0, start + 2.0  # 2 s of warm-up
        while (now := time.perf_counter()) < start + 2.0 + args.seconds:
            if now >= next_beat:
                next_beat = now + 0.5
                for s, sid in servers.items():
                    s.send_multipart(W.pack(W.Kind.BEAT, role=1, sender=sid, unstarted=W.encode_unstarted(0)))
                for t, tid in trainers.items():
                    t.send_multipart(W.pack(W.Kind.BEAT, role=2, sender=tid, sent_ms=int(now * 1000)))
            for t, tid in trainers.items():
                while inflight[t] < args.inflight and ready_batches:
                    seq, token = ready_batches.popleft()
                    sent[(t, seq)] = time.perf_counter()
                    inflight[t] += 1
                    t.send_multipart(W.pack(W.Kind.CLAIM, role=2, sender=tid, payload=[(seq, token)]))
            for sock, _ in poller.poll(5):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sock in servers:
                        msg = W.unpack(frames, W.TO_SERVER)
                        if msg.kind is W.Kind.LEASE:
                            counts["leases"] += now >= measure_from
                            base = msg.epoch * msg.batches
                            ready_batches.extend((base + int(b), int(tok)) for b, tok in msg.payload)
                    else:
                        msg = W.unpack(frames, W.TO_TRAINER)
                        if msg.kind is W.Kind.GRANTS:
                            at = time.perf_counter()
                            for seq, _tok, ok in msg.payload:
                                t0 = sent.pop((sock, int(seq)), None)
                                inflight[sock] -= 1
                                if at >= measure_from and t0 is not None:
                                    lat.append(at - t0)
                                    counts["grants" if ok else "refused"] += 1
                                if ok:
                                    sock.send_multipart(
                                        W.pack(W.Kind.DONE, role=2, sender=trainers[sock], payload=[int(seq)])
                                    )
                        elif msg.kind is W.Kind.DONE_OK and at_measure(now, measure_from):
                            counts["dones"] += len(msg.payload)
        stop.set()
        stats = json.loads(ready.get(timeout=30))
        child.join(30)
        for sock in [*servers, *trainers]:
            sock.close(linger=0)
        zctx.term()
    lat.sort()
    q = lambda p: 1000 * lat[min(int(p * len(lat)), len(lat) - 1)] if lat else float("nan")  # noqa: E731
    secs = args.seconds
    print(
        f"dispatcher process, journal on: {args.servers} servers, {args.trainers} trainers x {args.inflight} in flight, "
        f"{secs:g}s measured\n"
        f"  claims granted {counts['grants'] / secs:,.0f}/s (refused {counts['refused']}), dones {counts['dones'] / secs:,.0f}/s, "
        f"leases {counts['leases'] / secs:,.0f}/s\n"
        f"  claim latency p50 {q(0.5):.2f} ms  p99 {q(0.99):.2f} ms  max {q(1.0):.2f} ms  ({len(lat):,} claims)\n"
        f"  dispatcher's own counts: {stats}"
    )


def at_measure(now: float, measure_from: float) -> bool:
    return now >= measure_from


# ---- simulate: the real LeaseBook and Journal on a simulated clock ----
class SimServer:
    def __init__(self, sid: int, rate: float, joined: float):
        self.id, self.rate, self.joined = sid, rate, joined
        self.queue: collections.deque = collections.deque()  # (lease id, seq, token) in lease order
        self.credit = 0.0
        self.alive, self.stalled, self.died = True, False, None
        self.built = 0


def simulate(args) -> None:
    import logging

    from crossfeed.net.lease.book import LeaseBook
    from crossfeed.net.lease.journal import Journal

    logging.getLogger("crossfeed").setLevel(logging.ERROR)  # joins and deaths by the hundred
    rnd = random.Random(args.seed)
    dt, timeout = args.tick, 10.0
    batches = args.batches
    book = LeaseBook(
        batches, epochs=None, lease_size=8, window=64, timeout=timeout, lease_timeout=120.0, claim_timeout=300.0
    )
    tmp = tempfile.TemporaryDirectory()
    journal = Journal(Path(tmp.name) / "journal", plan={"t": "plan", "batches": batches, "epochs": None})
    journal.compact([])
    servers: dict[int, SimServer] = {}
    ids = iter(range(1, 1 << 40))

    def join(now: float, straggler: bool = False) -> None:
        rate = rnd.lognormvariate(math.log(args.server_rate), 0.5)
        s = SimServer(next(ids), rate / 20 if straggler else rate, now)
        servers[s.id] = s
        book.server_seen(s.id, now, address=f"tcp://h{s.id}:1")

    for i in range(args.servers):
        join(0.0, straggler=i < args.servers * args.stragglers)
    trainer_ids = [1_000_000_000 + i for i in range(args.trainers)]
    t_rate = {t: rnd.lognormvariate(math.log(args.trainer_rate), 0.3) for t in trainer_ids}
    t_credit = dict.fromkeys(trainer_ids, 0.0)
    buffers: dict[int, collections.deque] = {t: collections.deque() for t in trainer_ids}
    used = collections.Counter()
    granted: dict[int, set] = collections.defaultdict(set)  # epoch -> batches granted
    done_by_epoch = collections.Counter()
    per_trainer = collections.Counter()
    wall = {"book": 0.0, "journal": 0.0}
    stalled_at, stalled_ids = args.seconds * 0.3, []
    max_journal, waits, rr = 0, 0, 0
    ticks = int(args.seconds / dt)
    for tick in range(ticks):
        now = tick * dt
        # events: deaths, joins, stalls
        if tick == int(args.seconds * 0.2 / dt):
            for s in rnd.sample([s for s in servers.values() if s.alive], args.deaths):
                s.alive, s.died = False, now
        if tick == int(args.seconds * 0.25 / dt):
            for _ in range(args.joins):
                join(now)
        if tick == int(stalled_at / dt):
            for s in rnd.sample([s for s in servers.values() if s.alive and not s.stalled], args.stalls):
                s.stalled = True
                stalled_ids.append(s.id)
        w0 = time.perf_counter()
        for s in servers.values():  # beats (every tick: the book only keeps the last time)
            if s.alive:
                book.server_seen(s.id, now)
                if tick % int(1 / dt) == 0:
                    book.server_progress(s.id, max(len(s.queue) - 1, 0), now)
        for t in trainer_ids:
            book.trainer_seen(t, now)
        book.expire(now)
        leases = book.grant_leases(now)
        wall["book"] += time.perf_counter() - w0
        for lease in leases:
            s = servers[lease.server]
            base = lease.epoch * batches
            s.queue.extend((lease.id, base + b, tok) for b, tok in zip(lease.batches, lease.tokens))
        # servers build in lease order; a built batch goes to the next trainer with credit
        built = []
        for s in servers.values():
            if not s.alive or s.stalled or not s.queue:
                s.credit = 0.0
                continue
            s.credit += s.rate * dt
            while s.credit >= 1 and s.queue:
                s.credit -= 1
                _lid, seq, tok = s.queue.popleft()
                s.built += 1
                built.append((seq, tok))
        w0 = time.perf_counter()
        for seq, tok in built:
            for _ in range(len(trainer_ids)):
                t = trainer_ids[rr % len(trainer_ids)]
                rr += 1
                if len(buffers[t]) < 2:
                    break
            else:
                continue  # every trainer full: the batch waits at no one (dropped, as a refused copy)
            if book.claim(t, seq, tok, now=now):
                epoch, b = divmod(seq, batches)
                assert b not in granted[epoch], f"batch {b} of epoch {epoch} granted twice"
                granted[epoch].add(b)
                buffers[t].append(seq)
        # trainers use what they hold at their own rate
        for t in trainer_ids:
            t_credit[t] = min(t_credit[t] + t_rate[t] * dt, 2.0)
            while t_credit[t] >= 1 and buffers[t]:
                t_credit[t] -= 1
                seq = buffers[t].popleft()
                used[seq] += 1
                per_trainer[t] += 1
                done_by_epoch[seq // batches] += 1
                book.done(t, seq, now=now)
            if not buffers[t] and t_credit[t] >= 1:
                waits += 1
        wall["book"] += time.perf_counter() - w0
        w0 = time.perf_counter()
        journal.append(book.take_records())
        if journal.due():
            journal.compact(book.snapshot())
        wall["journal"] += time.perf_counter() - w0
        max_journal = max(max_journal, journal.path.stat().st_size)
    claims = sum(used.values())
    assert max(used.values()) == 1, "a batch used twice"
    whole = [e for e in done_by_epoch if done_by_epoch[e] == batches]
    for e in whole:
        assert len(granted[e]) == batches
    alive_secs = {
        s.id: ((s.died if s.died is not None else args.seconds) - s.joined) for s in servers.values() if not s.stalled
    }
    capacity = sum(servers[k].rate * v for k, v in alive_secs.items())
    demand = sum(t_rate.values()) * args.seconds
    util = sorted(servers[k].built / (servers[k].rate * v) for k, v in alive_secs.items() if v > 1 and servers[k].alive)
    shares = list(per_trainer.values())
    stalled_left = sum(book.outstanding(k) for k in stalled_ids)
    print(
        f"simulated {args.seconds:g}s (tick {dt * 1000:g} ms): {args.servers} servers (+{args.joins} joined, "
        f"{args.deaths} died, {args.stalls} stalled, {args.stragglers:.0%} stragglers at 1/20), {args.trainers} trainers\n"
        f"  batches used {claims:,} ({claims / args.seconds:,.0f}/s) of capacity {capacity / args.seconds:,.0f}/s "
        f"and demand {demand / args.seconds:,.0f}/s: {claims / min(capacity, demand):.1%} of the smaller\n"
        f"  whole epochs {len(whole)} of {batches:,} batches, every batch granted once and used once\n"
        f"  servers' built / (rate x time alive): p10 {util[len(util) // 10]:.2f} median {statistics.median(util):.2f} "
        f"p90 {util[9 * len(util) // 10]:.2f}\n"
        f"  trainers' batches: min {min(shares)} median {statistics.median(shares):.0f} max {max(shares)}; "
        f"trainer-ticks waiting with credit {waits:,}\n"
        f"  stalled servers' batches still leased at the end: {stalled_left}; taken over in all: "
        f"{book.counts['batches_taken_over']:,}; servers lost {book.counts['servers_lost']}\n"
        f"  journal at most {max_journal / 1e6:.2f} MB (compacted every {journal.compact_after:,} records)\n"
        f"  wall: book {1e6 * wall['book'] / max(claims, 1):.1f} us and journal {1e6 * wall['journal'] / max(claims, 1):.1f} us "
        f"per batch used; {1000 * wall['book'] / ticks:.2f} ms book per tick (a dispatcher loop pass)"
    )
    tmp.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("process")
    p.add_argument("--servers", type=int, default=32)
    p.add_argument("--trainers", type=int, default=64)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--batches", type=int, default=100_000)
    p.add_argument("--seconds", type=float, default=10.0)
    s = sub.add_parser("simulate")
    s.add_argument("--servers", type=int, default=1000)
    s.add_argument("--trainers", type=int, default=4096)
    s.add_argument("--seconds", type=float, default=60.0)
    s.add_argument("--tick", type=float, default=0.05)
    s.add_argument("--batches", type=int, default=50_000)
    s.add_argument("--server-rate", type=float, default=10.0)
    s.add_argument("--trainer-rate", type=float, default=3.0)
    s.add_argument("--stragglers", type=float, default=0.05)
    s.add_argument("--deaths", type=int, default=50)
    s.add_argument("--joins", type=int, default=100)
    s.add_argument("--stalls", type=int, default=10)
    s.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    process(args) if args.mode == "process" else simulate(args)


if __name__ == "__main__":
    main()
