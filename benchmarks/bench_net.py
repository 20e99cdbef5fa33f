"""serve → connect throughput beside raw pyzmq sending the same buffers, in one run.

    python benchmarks/bench_net.py [--seconds 3] [--servers 1,2,4] [--parts large,small,servers]

Measures, each over tcp loopback and ipc:
  * large batches: 128x224x224x3 uint8 (19.3 MB) — crossfeed (credit flow, acks, wire format)
    against a raw PUSH/PULL pair sending the same buffer zero-copy; prints GB/s and the ratio;
  * small batches (one 16-float field + 16 sample ids): messages/s, crossfeed against raw,
    with the default credits and with --credits (small batches are bound by the ack round
    trip: the more in flight, the faster);
  * M servers → 1 client (tcp, large batches).
Senders run in their own processes (spawn), the receiver in this one; nothing else is measured.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LARGE = (128, 224, 224, 3)
SMALL = (16,)


def _batch(shape) -> dict:
    dtype = np.uint8 if len(shape) > 1 else np.float32
    return {"x": np.ones(shape, dtype), "__index__": np.arange(shape[0], dtype=np.int64)}


# ---- processes --------------------------------------------------------------------------


def _raw_sender(address: str, shape, ready) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.sndhwm = 4
    sock.bind(address)
    ready.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    batch = _batch(shape)
    frames = [b"header" * 8, batch["__index__"], batch["x"]]
    try:
        while True:
            sock.send_multipart(frames, copy=False)
    finally:
        sock.close(linger=0)
        ctx.term()


def _server(address: str, shape, ready) -> None:
    from crossfeed.net import Server, ServerOptions

    batch = _batch(shape)

    def forever(epoch):
        for _ in range(1000):
            yield batch

    with Server(forever, ServerOptions((address,))) as server:
        ready.put(server.endpoints[0])
        server.wait()


def _start(target, address, shape):
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=target, args=(address, shape, ready), daemon=True)
    proc.start()
    return proc, ready.get(timeout=60)


# ---- receivers ---------------------------------------------------------------------------


def _time_loop(next_message, seconds: float, nbytes: int) -> tuple[float, float]:
    """(messages/s, GB/s) after a short warm-up."""
    for _ in range(3):
        next_message()
    count, start = 0, time.perf_counter()
    while True:
        next_message()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed, count * nbytes / elapsed / 1e9


def raw(address: str, shape, seconds: float) -> tuple[float, float]:
    proc, endpoint = _start(_raw_sender, address, shape)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.rcvhwm = 4
    sock.connect(endpoint)
    try:

        def receive():
            frames = sock.recv_multipart(copy=False)
            return np.frombuffer(frames[2].buffer, np.uint8)

        return _time_loop(receive, seconds, int(np.prod(shape)) * (1 if len(shape) > 1 else 4))
    finally:
        sock.close(linger=0)
        ctx.term()
        proc.kill()
        proc.join(10)


def ours(addresses: list[str], shape, seconds: float, credits: int | None = None) -> tuple[float, float]:
    """crossfeed's rate; `credits` None: the client's default."""
    from crossfeed.net import connect

    procs, endpoints = zip(*[_start(_server, a, shape) for a in addresses])
    try:
        with connect(list(endpoints), **({} if credits is None else {"credits": credits})) as client:
            return _time_loop(lambda: next(client), seconds, int(np.prod(shape)) * (1 if len(shape) > 1 else 4))
    finally:
        for p in procs:
            p.kill()
            p.join(10)


def main(argv=None) -> None:
    from crossfeed.net.stream.client import DEFAULT_CREDITS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--servers", default="1,2,4")
    parser.add_argument("--parts", default="large,small,servers", help="which tables to print")
    parser.add_argument("--transports", default="tcp,ipc")
    parser.add_argument("--credits", default="4,64", help="client credits to try besides the default")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    tmp = tempfile.mkdtemp(prefix="crossfeed-bench-")
    transports = {"tcp": lambda n: "tcp://127.0.0.1:0", "ipc": lambda n: f"ipc://{tmp}/{n}.sock"}
    transports = {k: v for k, v in transports.items() if k in args.transports.split(",")}
    print(f"crossfeed network benchmark ({os.cpu_count()} cores, {args.seconds:g}s per figure)")
    if "large" in parts:
        print(f"large batches {'x'.join(map(str, LARGE))} uint8 ({np.prod(LARGE) / 1e6:.1f} MB)")
    for name, addr in transports.items() if "large" in parts else ():
        r_mps, r_gbs = raw(addr("raw"), LARGE, args.seconds)
        o_mps, o_gbs = ours([addr("ours")], LARGE, args.seconds)
        print(
            f"  {name}: crossfeed {o_gbs:6.2f} GB/s ({o_mps:6.1f} batches/s)   raw pyzmq {r_gbs:6.2f} GB/s "
            f"({r_mps:6.1f}/s)   ratio {o_gbs / r_gbs:.2f}"
        )
    if "small" in parts:
        print(f"small batches {'x'.join(map(str, SMALL))} float32 + 16 sample ids")
    for name, addr in transports.items() if "small" in parts else ():
        r_mps, _ = raw(addr("raw-small"), SMALL, args.seconds)
        for credits in [None, *(int(c) for c in args.credits.split(",") if c)]:
            o_mps, _ = ours([addr(f"ours-small-{credits}")], SMALL, args.seconds, credits)
            label = f"{DEFAULT_CREDITS} default" if credits is None else f"{credits}"
            print(
                f"  {name}: crossfeed (credits={label:>10}) {o_mps:9.0f} msg/s   raw pyzmq {r_mps:9.0f} msg/s"
                f"   ratio {o_mps / r_mps:.2f}"
            )
    if "servers" in parts:
        print("M servers -> 1 client, tcp, large batches")
    for m in (int(x) for x in args.servers.split(",") if "servers" in parts):
        o_mps, o_gbs = ours(["tcp://127.0.0.1:0"] * m, LARGE, args.seconds)
        print(f"  M={m}: {o_gbs:6.2f} GB/s ({o_mps:6.1f} batches/s)")


if __name__ == "__main__":
    main()
