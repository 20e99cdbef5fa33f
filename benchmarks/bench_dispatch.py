"""Dispatched serving (leases, claims, journal) beside static shares (--rank/--world-size), one run.

    python benchmarks/bench_dispatch.py [--samples 20000] [--batch-size 64] [--servers 2] [--rounds 2]
        [--serve-args "--procs 2 --transform benchmarks.bench_dispatch:busy"]

Writes a dataset of 32x32x3 uint8 images + labels in a temporary folder, then per round and
mode starts the servers as `crossfeed serve` processes (static: `--rank r --world-size M`;
dispatched: one `crossfeed dispatch` and M `serve --dispatcher`) and reads one epoch with one
trainer in this process over loopback tcp. Prints samples/s from the first batch to the end of
the epoch (start-up excluded), the dispatched/static ratio, and checks that every sample came once.
``--serve-args`` go to every `serve` of both modes (e.g. ``--procs N`` or ``--threads N`` with
``--transform benchmarks.bench_dispatch:busy``, a per-sample Python transform).
"""

from __future__ import annotations

import argparse
import collections
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def busy(sample: dict) -> dict:
    """A per-sample Python transform (module-level: worker processes import it): a flip and a
    little pure-Python work, holding the GIL as augmentation code does."""
    acc = 0
    for v in sample["image"][:, :, 0].ravel().tolist():
        acc = (acc * 31 + v) % 1000003
    return {**sample, "image": np.ascontiguousarray(sample["image"][:, ::-1]), "check": np.int64(acc)}


def cli(*argv: str, log: Path) -> subprocess.Popen:
    code = "from crossfeed.cli.main import app; import sys; app(sys.argv[1:], prog_name='crossfeed')"
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", code, *argv], stdout=out, stderr=subprocess.STDOUT)


def endpoint(path: Path, procs, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit(f"a process failed; see {path.parent}")
        time.sleep(0.05)
    raise SystemExit(f"no endpoint in {path}")


def consume(batches) -> tuple[float, collections.Counter]:
    seen: collections.Counter = collections.Counter()
    start = None
    with batches as it:
        for meta, _batch in it:
            if start is None:
                start = time.perf_counter()
            seen.update(meta.sample_ids.tolist())
    return time.perf_counter() - start, seen


def run(mode: str, ds: str, work: Path, args) -> tuple[float, collections.Counter]:
    import crossfeed

    common = ["--batch-size", str(args.batch_size), "--shuffle", "none"]
    procs = []
    try:
        if mode == "static":
            addrs = []
            for r in range(args.servers):
                ep = work / f"{mode}{r}.ep"
                ep.unlink(missing_ok=True)
                argv = ["serve", ds, "tcp://127.0.0.1:0", *common, "--epochs", "1"]
                argv += ["--rank", str(r), "--world-size", str(args.servers), "--endpoint-file", str(ep)]
                argv += shlex.split(args.serve_args)
                procs.append(cli(*argv, log=work / f"{mode}{r}.log"))
                addrs.append(endpoint(ep, procs))
            batches = crossfeed.connect(addrs, with_meta=True)
        else:
            ep = work / "d.ep"
            ep.unlink(missing_ok=True)
            journal = work / f"journal{time.monotonic_ns()}"
            argv = ["dispatch", ds, "tcp://127.0.0.1:0", *common, "--journal", str(journal), "--endpoint-file", str(ep)]
            procs.append(cli(*argv, log=work / "d.log"))
            address = endpoint(ep, procs)
            for r in range(args.servers):
                argv = ["serve", ds, "tcp://127.0.0.1:0", "--dispatcher", address, *shlex.split(args.serve_args)]
                procs.append(cli(*argv, log=work / f"s{r}.log"))
            batches = crossfeed.connect(dispatcher=address, with_meta=True)
        return consume(batches)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve-args", default="", help="extra `serve` arguments for both modes, e.g. '--procs 2'")
    args = ap.parse_args(argv)
    import crossfeed

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ds = str(work / "ds")
        rng = np.random.default_rng(0)
        samples = ({"image": rng.integers(0, 255, (32, 32, 3), np.uint8), "label": i} for i in range(args.samples))
        crossfeed.write_dataset(ds, samples, num_shards=8).close()
        rates = collections.defaultdict(list)
        for r in range(args.rounds):
            for mode in ("static", "dispatched"):
                seconds, seen = run(mode, ds, work, args)
                ok = seen == collections.Counter(range(args.samples))
                rate = args.samples / seconds
                rates[mode].append(rate)
                print(f"round {r} {mode:>10}: {rate:10.0f} samples/s  every sample once: {ok}", flush=True)
        best = {m: max(v) for m, v in rates.items()}
        print(
            f"{args.servers} servers -> 1 trainer, {args.samples} samples, batch {args.batch_size}: "
            f"static {best['static']:.0f}/s, dispatched {best['dispatched']:.0f}/s, "
            f"ratio dispatched/static {best['dispatched'] / best['static']:.2f} (best of {args.rounds})"
            + (f", serve {args.serve_args}" if args.serve_args else "")
        )


if __name__ == "__main__":
    main()
