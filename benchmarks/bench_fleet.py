"""Mixed-speed servers, measured with real processes: what a trainer receives from a fleet.

    python benchmarks/bench_fleet.py [--seconds 10] [--samples 8000] [--batch-size 4]
                                     [--fast-ms 2] [--slow-ms 3] [--straggler 20] [--only NAME ...]

Every server is a real `crossfeed serve` process whose `--transform` sleeps a fixed time per
sample (`sleep_sample`, the GIL released: the servers do not take CPU from one another on a
small machine, so their solo rates add up); the trainer is a real process reading through
`crossfeed.connect` as fast as it can (it writes one line per batch: far faster than the
servers). Configurations, each timed over `--seconds` from `--warmup` s after its first batch:

  dispatch (`crossfeed dispatch` at its defaults, `serve --dispatcher`, `connect(dispatcher=)`):
    A, B             a server alone (A sleeps `--fast-ms` a sample, B `--slow-ms`): r1, r2
    A+B              both: goal >= 0.9 x (r1 + r2)
    A+B+S            A and B with a straggler S, `--straggler` times slower than A: goal >= 0.95 x (A+B)
    A+B+stalled      A and B with a server whose transform never returns (alive, beating): its
                     work carried by the others (goal: at their own rate, long before the lease
                     timeout, 120 s)
  serve (no dispatcher: static shares, `serve --rank i --world-size N`, `connect([a, b, ...])`):
    serve A, serve B, serve A+B   goal: the pair >= 0.9 x (r1 + r2)
    serve A+B+S                   with the straggler: goal >= 0.95 x serve A+B

Prints each configuration's batches/s, the share each server delivered, the ratios against the
goals, whether every sample was used once in each whole epoch the trainer received (dispatch),
and the machine's load average (the servers sleep, but the trainer, dispatcher and the servers'
own loops take CPU).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sleep_sample(sample: dict) -> dict:
    """The servers' transform: sleep CF_FLEET_SLEEP_MS ms (the GIL released), the sample unchanged."""
    time.sleep(float(os.environ.get("CF_FLEET_SLEEP_MS", "0")) / 1000)
    return sample


def trainer(out_file: str, dispatcher: str, addresses: str) -> None:
    """One JSON line per batch ([time, sample ids, server id]); runs until killed."""
    from crossfeed import connect

    where = {"dispatcher": dispatcher} if dispatcher else {"addresses": addresses.split()}
    with open(out_file, "a", buffering=1 << 16) as out, connect(**where, with_meta=True, connect_timeout=30.0) as c:
        last = time.monotonic()
        for meta, _batch in c:
            now = time.monotonic()
            out.write(json.dumps([now, meta.sample_ids.tolist(), meta.server_id]) + "\n")
            if now - last > 0.2:
                out.flush()
                last = now


def _spawn(argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    with open(log, "ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "crossfeed.cli.main", "--verbose", *argv]


def _wait(pred, timeout: float, what: str, procs=()):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a child exited ({p.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(10)


def _lines(path: Path) -> list:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a last line cut short
    return out


def run_config(tmp: Path, args, name: str, sleeps: list[float], *, dispatch: bool) -> dict:
    """One configuration: servers sleeping `sleeps` ms a sample; the trainer's batches over the window."""
    procs: list[subprocess.Popen] = []
    ds = str(tmp / "ds")
    common = ["--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    load_before = os.getloadavg()[0]
    try:
        if dispatch:
            ep = tmp / f"{name}.dep"
            argv = _cli("dispatch", ds, "tcp://127.0.0.1:0", "--endpoint-file", str(ep), *common[:2])
            argv += ["--epochs", "100000"]
            procs.append(_spawn(argv, tmp / f"{name}-d.log"))
            address = _wait(lambda: ep.exists() and ep.read_text().strip(), 60, "the dispatcher", procs)
        servers, eps = [], []
        for i, ms in enumerate(sleeps):
            ep = tmp / f"{name}-s{i}.ep"
            where = ["--dispatcher", address] if dispatch else ["--rank", str(i), "--world-size", str(len(sleeps))]
            argv = _cli("serve", ds, "tcp://127.0.0.1:0", "--endpoint-file", str(ep), *common, *where)
            argv += ["--transform", "benchmarks.bench_fleet:sleep_sample"]
            p = _spawn(argv, tmp / f"{name}-s{i}.log", {"CF_FLEET_SLEEP_MS": str(ms)})
            servers.append(p)
            procs.append(p)
            eps.append(ep)
        addresses = [_wait(lambda e=e: e.exists() and e.read_text().strip(), 60, "a server", procs) for e in eps]
        if dispatch:
            logs = [tmp / f"{name}-s{i}.log" for i in range(len(sleeps))]
            _wait(lambda: all("joined the dispatcher" in x.read_text() for x in logs), 60, "the servers' joins", procs)
        out = tmp / f"{name}.out"
        code = f"from benchmarks.bench_fleet import trainer; trainer({str(out)!r}, {address if dispatch else ''!r}, {' '.join(addresses)!r})"
        procs.append(_spawn([sys.executable, "-c", code], tmp / f"{name}-t.log"))
        first = _wait(lambda: _lines(out), 60, "a first batch", procs)[0][0]
        # the window is measured on the trainer's own clock (its lines' times)
        _wait(lambda: (x := _lines(out)) and x[-1][0] > first + args.warmup + args.seconds + 0.3, 120, "the run", procs)
    finally:
        _stop(procs[::-1])
    lines = _lines(out)
    t0 = first + args.warmup
    window = [x for x in lines if t0 <= x[0] < t0 + args.seconds]
    by_pid = collections.Counter(x[2].rsplit(":", 1)[-1] for x in window)
    shares = [by_pid.get(str(p.pid), 0) / max(len(window), 1) for p in servers]
    epochs, once = _epochs_once(lines, args) if dispatch else (None, None)
    taken = 0
    if dispatch:
        for line in (tmp / f"{name}-d.log").read_text().splitlines():
            if "takes over" in line:
                taken += int(line.split("takes over ")[1].split()[0])
    return {
        "name": name,
        "rate": len(window) / args.seconds,
        "shares": shares,
        "epochs": epochs,
        "once": once,
        "taken_over_logged": taken,
        "load": (load_before, os.getloadavg()[0]),
    }


def _epochs_once(lines, args) -> tuple[int, bool]:
    """Whole epochs the trainer received (in order: the next is leased once this one is used),
    and whether each used every sample once."""
    per = args.samples // args.batch_size
    whole = len(lines) // per
    for e in range(whole):
        got = collections.Counter(i for x in lines[e * per : (e + 1) * per] for i in x[1])
        if got != collections.Counter(range(args.samples)):
            return whole, False
    return whole, True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds after the first batch before the window")
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="each server's Loader threads")
    ap.add_argument("--fast-ms", type=float, default=2.0)
    ap.add_argument("--slow-ms", type=float, default=3.0)
    ap.add_argument("--straggler", type=float, default=20.0)
    ap.add_argument("--only", nargs="*", default=None, help="configuration names to run (default: all)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import logging

    logging.disable(logging.WARNING)
    from tests.dispatch_helpers import write_dataset

    a, b, s, hang = args.fast_ms, args.slow_ms, args.fast_ms * args.straggler, 600_000.0
    plan = [
        ("A", [a], True),
        ("B", [b], True),
        ("A+B", [a, b], True),
        ("A+B+S", [a, b, s], True),
        ("A+B+stalled", [a, b, hang], True),
        ("serve A", [a], False),
        ("serve B", [b], False),
        ("serve A+B", [a, b], False),
        ("serve A+B+S", [a, b, s], False),
    ]
    print(
        f"# {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {args.samples} samples of int64[4], batch "
        f"{args.batch_size}, {args.samples // args.batch_size} batches an epoch; servers --threads {args.threads}; "
        f"A {a} ms a sample, B {b} ms, straggler S {s} ms; {args.seconds:g} s timed after {args.warmup:g} s"
    )
    got: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_dataset(str(Path(tmp) / "ds"), args.samples)
        for name, sleeps, dispatch in plan:
            if args.only and name not in args.only:
                continue
            r = run_config(Path(tmp), args, name.replace(" ", "_").replace("+", "_"), sleeps, dispatch=dispatch)
            got[name] = r
            shares = " ".join(f"{x:.0%}" for x in r["shares"])
            extra = f"; {r['epochs']} whole epochs, each sample once: {r['once']}" if dispatch else ""
            extra += f"; taken over: {r['taken_over_logged']}" if r["taken_over_logged"] else ""
            print(
                f"{name:14s} {r['rate']:7.1f} batches/s  shares {shares}{extra}  "
                f"(load {r['load'][0]:.2f} -> {r['load'][1]:.2f})",
                flush=True,
            )

    def ratio(x: str, *ys: str) -> str:
        if x not in got or any(y not in got for y in ys):
            return "n/a"
        return f"{got[x]['rate'] / sum(got[y]['rate'] for y in ys):.2f}"

    print(f"dispatch A+B / (A + B)        = {ratio('A+B', 'A', 'B')}  (goal >= 0.90)")
    print(f"dispatch A+B+S / A+B          = {ratio('A+B+S', 'A+B')}  (goal >= 0.95)")
    print(f"dispatch A+B+stalled / A+B    = {ratio('A+B+stalled', 'A+B')}")
    print(f"serve A+B / (serve A + B)     = {ratio('serve A+B', 'serve A', 'serve B')}  (goal >= 0.90)")
    print(f"serve A+B+S / serve A+B       = {ratio('serve A+B+S', 'serve A+B')}  (goal >= 0.95)")


if __name__ == "__main__":
    main()
