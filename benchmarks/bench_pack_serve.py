"""Packed token rows through `crossfeed serve` → `crossfeed.connect` beside the Loader, in one run.

One generated corpus (``--docs`` documents of log-normal length, mean ~600 tokens, uint32; the
corpus and writer of ``bench_tokens.py``), one shuffled epoch in rows of ``--length`` tokens,
batches of ``--batch`` rows, each packing mode (``split="rows"``, best-fit), three ways:

* **Loader**: ``Loader(xf, batch_size=B, pack=Pack(L, split=...), num_threads=0)`` in this process;
* **serve**: one ``crossfeed serve xf tcp://127.0.0.1:0 --pack-length L --pack-split ... --epochs 1``
  process (the same plan, ``--threads 0``), read by ``crossfeed.connect`` here over loopback TCP;
* **dispatch**: the same server under ``crossfeed dispatch`` (leases, claims, a journal in a temp
  folder), read through ``crossfeed.connect(dispatcher=...)``.

Printed: row tokens per second (the first batch excluded) and each way's ratio to the Loader in
the same run, with the machine's load. The trainer only counts what it receives (and checks every
token's id sum against the Loader's epoch), so the ratio is the serving path's cost.

    .venv/bin/python benchmarks/bench_pack_serve.py --docs 50000 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_tokens  # noqa: E402  (the corpus and its writer)

CLI = os.path.join(os.path.dirname(sys.executable), "crossfeed")


def _count(batches) -> tuple[float, int, int]:
    """(tokens/s from the second batch, tokens, id sum) of an iterable of packed batches; the
    id sum's own time is left out of the rate."""
    tokens = total = 0
    t0 = None
    checking = 0.0
    for b in batches:
        x = np.asarray(b["tokens"])
        c = time.perf_counter()
        if t0 is None:
            t0, first = c, x.size
        tokens += x.size
        total += int(x.sum(dtype=np.int64))
        checking += time.perf_counter() - c
    seconds = time.perf_counter() - t0 - checking if t0 is not None else float("nan")
    return (tokens - first) / seconds, tokens, total


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


def run(xf: str, way: str, split: str, length: int, batch: int, tmp: str) -> tuple[float, int, int]:
    import crossfeed

    if way == "loader":
        pack = crossfeed.Pack(length, split=split)
        with crossfeed.Loader(xf, batch_size=batch, seed=0, pack=pack, num_threads=0) as ld:
            return _count(ld)
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
                return _count(client)
        slog, send = os.path.join(tmp, "s.log"), os.path.join(tmp, "s.endpoint")
        argv = [CLI, "serve", xf, "tcp://127.0.0.1:0", "--epochs", "1", *SERVE_ARGS, "--endpoint-file", send]
        procs.append(subprocess.Popen([*argv, *plan], stdout=open(slog, "w"), stderr=subprocess.STDOUT))
        address = _endpoint(send, procs[-1], slog)
        with crossfeed.connect(address, **CLIENT) as client:
            return _count(client)
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
    ap.add_argument("--ways", default="loader,serve,dispatch")
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
        for way, (rate, tokens, total) in best.items():
            ratio = f"{rate / ref[0]:.2f}× the Loader" if ref else ""
            same = "every token as the Loader's" if ref and (tokens, total) == ref[1:] else f"{tokens:,} tokens"
            print(f"  split={split:<9s} {way:<8s} {rate / 1e6:8.1f} M tokens/s  {ratio:<18s} {same}")
    print(f"(load now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
