"""Packed token rows through `crossfeed serve` → `crossfeed.connect` beside the Loader, in one run.

One generated corpus (``--docs`` documents of log-normal length, mean ~600 tokens, uint32; the
corpus and writer of ``bench_tokens.py``), one shuffled epoch in rows of ``--length`` tokens,
batches of ``--batch`` rows, each packing mode (``split="rows"``, best-fit), three ways:

* **Loader**: ``Loader(xf, batch_size=B, pack=Pack(L, split=...), num_threads=0)`` in this process;
* **serve**: one ``crossfeed serve xf tcp://127.0.0.1:0 --pack-length L --pack-split ... --epochs 1``
  process (the same plan, ``--threads 0``), read by ``crossfeed.connect`` here over loopback TCP;
* **dispatch**: the same server under ``crossfeed dispatch`` (leases, claims, a journal in a temp
  folder), read through ``crossfeed.connect(dispatcher=...)``.

and, with ``--ways ...,floor``, the transport alone:

* **floor**: one process sending the frames of one packed batch (the same three arrays, encoded
  once by `crossfeed.format.wire`) over and over through a bare ZeroMQ ROUTER to a DEALER here,
  at most 32 in flight, acknowledged every 16, each decoded by `wire.decode`: no build, no
  server bookkeeping, as many batches as the Loader's epoch has. What loopback TCP and pyzmq cost
  a batch of this size on this machine, the bound under the other ways.

Printed: row tokens per second (from the second batch to the epoch's last: not the wait for the
stream's end) and each way's ratio to the Loader in the same run, with the machine's load; and
the CPU time per batch (user + system, every thread, over the same batches: not the other
processes shutting down while the trainer waits for the end) of the trainer (this process: receiving, decoding,
acknowledging; the id sums left out) and of the other processes of that way (the server, or the
dispatcher and its server — also each apart, in brackets —, or the floor's sender). The trainer
only counts what it receives (and checks every token's id sum against the Loader's epoch), so
the ratio is the serving path's cost.

    .venv/bin/python benchmarks/bench_pack_serve.py --docs 50000 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_tokens  # noqa: E402  (the corpus and its writer)

CLI = os.path.join(os.path.dirname(sys.executable), "crossfeed")


def _cpu(pids: list[int]) -> float:
    """CPU seconds (user + system, all threads) used so far by the processes `pids` (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _count(batches, peers: list[int] = (), last: int | None = None) -> tuple[float, int, int, float, float, list]:
    """(tokens/s from the second batch, tokens, id sum, this process's and `peers`' CPU seconds
    per batch from the second batch, and each peer's) of an iterable of packed batches, up to its
    `last`-th batch (the epoch's end: what the processes do after it, the wait for the end of the
    stream and shutting down, left out; None: up to the iterable's end); the id sum's own time is
    left out of the rate and of this process's CPU."""
    tokens = total = n = 0
    t0 = end = None
    checking = checking_cpu = 0.0

    def now() -> tuple:  # the clocks, and what was counted so far
        return time.perf_counter(), _own_cpu(), [_cpu([p]) for p in peers], checking, checking_cpu, n, tokens

    for b in batches:
        x = np.asarray(b["tokens"])
        c, cc = time.perf_counter(), time.thread_time()
        if t0 is None:
            t0, first, own0 = c, x.size, _own_cpu()
            peers0 = [_cpu([p]) for p in peers]
        n += 1
        tokens += x.size
        total += int(x.sum(dtype=np.int64))
        checking += time.perf_counter() - c
        checking_cpu += time.thread_time() - cc
        if n == last:
            end = now()
    if t0 is None or n < 2:
        return float("nan"), tokens, total, float("nan"), float("nan"), []
    if end is None:
        end = now()
    at, own1, peers1, checked, checked_cpu, m, counted = end
    seconds = at - t0 - checked
    own = (own1 - own0 - checked_cpu) / (m - 1)
    each = [(c1 - c0) / (m - 1) for c0, c1 in zip(peers0, peers1)]
    other = sum(each) if peers else float("nan")
    return (counted - first) / seconds, tokens, total, own, other, each


# the floor's sender: argv = endpoint file, batches, batch rows, row length; sends the frames of
# one packed batch `batches` times to the first DEALER that says hello, 32 in flight, then "end"
FLOOR_SENDER = r"""
import sys, numpy as np, zmq
from crossfeed.format import wire
out, n, rows, length = sys.argv[1], *map(int, sys.argv[2:5])
rng = np.random.default_rng(0)
batch = {"tokens": rng.integers(0, 50_000, (rows, length)).astype(np.uint32),
         "segment_ids": np.repeat(np.arange(1, 5, dtype=np.int32), length // 4)[None].repeat(rows, 0),
         "positions": np.tile(np.arange(length // 4, dtype=np.int32), 4)[None].repeat(rows, 0)}
frames = [b"batch", *wire.encode(batch, wire.BatchMeta(seq=0, server_id="floor"))]
ctx = zmq.Context(); sock = ctx.socket(zmq.ROUTER); port = sock.bind_to_random_port("tcp://127.0.0.1")
open(out + ".tmp", "w").write(f"tcp://127.0.0.1:{port}"); __import__("os").rename(out + ".tmp", out)
peer, _ = sock.recv_multipart()
sent = acked = 0
while sent < n:
    if sent - acked < 32:
        sock.send(peer, zmq.SNDMORE)
        sock.send_multipart(frames, copy=False)
        sent += 1
    else:
        sock.recv_multipart()
        acked += 16
sock.send_multipart([peer, b"end"]); sock.recv_multipart(); sock.close(linger=1000); ctx.term()
"""


def _floor(batches: int, rows: int, length: int, tmp: str):
    """The transport alone: batches from FLOOR_SENDER, decoded here as a trainer decodes them."""
    import zmq

    from crossfeed.format import wire

    end = os.path.join(tmp, "floor.endpoint")
    proc = subprocess.Popen([sys.executable, "-c", FLOOR_SENDER, end, str(batches), str(rows), str(length)])
    try:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(_endpoint(end, proc, os.devnull))
        sock.send(b"hello")

        def received():
            got = 0
            while True:
                frames = sock.recv_multipart(copy=False)
                if frames[0].bytes == b"end":
                    sock.send(b"bye")
                    return
                got += 1
                if got % 16 == 0:
                    sock.send(b"ack")
                yield wire.decode(frames[1:])[1]

        try:
            return _count(received(), [proc.pid])
        finally:
            sock.close(linger=1000)
            ctx.term()
    finally:
        proc.wait(30)


def _endpoint(path: str, proc: subprocess.Popen, log: str) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.getsize(path):
            with open(path) as f:
                return f.read().split()[0]
        if proc.poll() is not None:
            raise SystemExit(f"the process ended: {open(log).read()[-2000:]}")
        time.sleep(0.05)
    raise SystemExit(f"no endpoint after 60 s: {open(log).read()[-2000:]}")


def _plan(length: int, batch: int, split: str) -> list[str]:
    return ["--batch-size", str(batch), "--seed", "0", "--pack-length", str(length), "--pack-split", split]


SERVE_ARGS: list[str] = ["--threads", "0"]  # --serve-args
CLIENT: dict = {}  # --credits


BATCHES: dict[str, int] = {}  # split -> the Loader's batches in the epoch (the floor sends as many)


def run(xf: str, way: str, split: str, length: int, batch: int, tmp: str) -> tuple:
    import crossfeed

    if way == "loader":
        pack = crossfeed.Pack(length, split=split)
        with crossfeed.Loader(xf, batch_size=batch, seed=0, pack=pack, num_threads=0) as ld:
            BATCHES[split] = len(ld)
            return _count(ld)
    if way == "floor":
        if split not in BATCHES:
            with crossfeed.Loader(xf, batch_size=batch, seed=0, pack=crossfeed.Pack(length, split=split)) as ld:
                BATCHES[split] = len(ld)
        return _floor(BATCHES[split], batch, length, tmp)
    procs, logs = [], []
    try:
        plan = _plan(length, batch, split)
        if way == "dispatch":
            dlog, dend = os.path.join(tmp, "d.log"), os.path.join(tmp, "d.endpoint")
            journal = os.path.join(tmp, "journal")
            argv = [CLI, "dispatch", xf, "tcp://127.0.0.1:0", "--epochs", "1", "--journal", journal]
            argv += ["--endpoint-file", dend, *plan]
            procs.append(subprocess.Popen(argv, stdout=open(dlog, "w"), stderr=subprocess.STDOUT))
            logs.append(dlog)
            dispatcher = _endpoint(dend, procs[-1], dlog)
            slog = os.path.join(tmp, "s.log")
            argv = [CLI, "serve", xf, "tcp://127.0.0.1:0", "--dispatcher", dispatcher, *SERVE_ARGS]
            procs.append(subprocess.Popen(argv, stdout=open(slog, "w"), stderr=subprocess.STDOUT))
            with crossfeed.connect(dispatcher=dispatcher, **CLIENT) as client:
                return _count(client, [p.pid for p in procs], BATCHES.get(split))
        slog, send = os.path.join(tmp, "s.log"), os.path.join(tmp, "s.endpoint")
        argv = [CLI, "serve", xf, "tcp://127.0.0.1:0", "--epochs", "1", *SERVE_ARGS, "--endpoint-file", send]
        procs.append(subprocess.Popen([*argv, *plan], stdout=open(slog, "w"), stderr=subprocess.STDOUT))
        address = _endpoint(send, procs[-1], slog)
        with crossfeed.connect(address, **CLIENT) as client:
            return _count(client, [p.pid for p in procs], BATCHES.get(split))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--length", type=int, default=bench_tokens.LENGTH)
    ap.add_argument("--batch", type=int, default=bench_tokens.BATCH)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--splits", default="rows,documents")
    ap.add_argument("--ways", default="loader,serve,dispatch", help="of loader, serve, dispatch, floor")
    ap.add_argument("--data", default=os.environ.get("CROSSFEED_BENCH_DATA", os.path.join(bench_tokens.HERE, "_data")))
    ap.add_argument("--serve-args", default="--threads 0", help="the server's Loader flags (default: --threads 0)")
    ap.add_argument("--credits", type=int, help="batches each server may have in flight (connect's credits=)")
    args = ap.parse_args()
    SERVE_ARGS[:] = args.serve_args.split()
    if args.credits:
        CLIENT["credits"] = args.credits
    root = bench_tokens.corpus(args.data, args.docs)
    xf = os.path.join(root, "xf")
    if not os.path.exists(os.path.join(xf, "crossfeed.json")):
        bench_tokens.write_crossfeed(root)
    print(
        f"{args.docs:,} documents, rows of {args.length}, batch {args.batch}, best of {args.repeat} (load {os.getloadavg()[0]:.2f})"
    )
    for split in args.splits.split(","):
        best: dict[str, tuple] = {}
        for _ in range(args.repeat):
            for way in args.ways.split(","):
                with tempfile.TemporaryDirectory() as tmp:
                    got = run(xf, way, split, args.length, args.batch, tmp)
                if way not in best or got[0] > best[way][0]:
                    best[way] = got
        ref = best.get("loader")
        for way, (rate, tokens, total, own, other, each) in best.items():
            ratio = f"{rate / ref[0]:.2f}× the Loader" if ref else ""
            if way == "floor":
                same = "(one batch's frames, sent again and again)"
            else:
                same = "every token as the Loader's" if ref and (tokens, total) == ref[1:3] else f"{tokens:,} tokens"
            cpu = f"trainer {own * 1e6:4.0f} µs" + ("" if other != other else f", others {other * 1e6:4.0f} µs")
            if len(each) > 1:  # the dispatcher's and its server's own
                cpu += " (" + " + ".join(f"{e * 1e6:.0f}" for e in each) + ")"
            print(
                f"  split={split:<9s} {way:<8s} {rate / 1e6:8.1f} M tokens/s  {ratio:<18s} CPU/batch: {cpu:<32s} {same}"
            )
    print(f"(load now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
