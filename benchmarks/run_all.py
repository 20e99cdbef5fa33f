"""``make bench``: every benchmark, one after another, each in a process of its own (TensorFlow,
torch and the tfrecord package do not share one process well). ``--quick`` passes the small
sizes to those that have them. Each benchmark prints its own table with the peer beside it."""

from __future__ import annotations

import subprocess
import sys
import time

BENCHMARKS = [
    ("record reads vs tf.data", ["-m", "benchmarks.bench_records"], ["--quick"]),
    ("Loader vs tf.data, tfrecord, webdataset", ["benchmarks/bench_loader.py"], ["--quick"]),
    ("PyTorch DataLoader vs tfrecord, webdataset", ["-m", "benchmarks.bench_torch"], ["--quick"]),
    ("TensorFlow engines vs hand-written tf.data", ["benchmarks/bench_tf.py"], []),
    ("Beam conversion vs a plain loop", ["benchmarks/bench_convert.py"], ["--rows", "20000", "--images", "300"]),
    ("serve/connect vs raw pyzmq", ["benchmarks/bench_net.py"], []),
]


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    failed = []
    for title, cmd, quick_args in BENCHMARKS:
        print(f"\n### {title}: python {' '.join(cmd + (quick_args if quick else []))}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, *cmd, *(quick_args if quick else [])])
        print(f"### exit {rc} after {time.perf_counter() - start:.0f} s", flush=True)
        if rc:
            failed.append(title)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
