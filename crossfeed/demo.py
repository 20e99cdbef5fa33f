"""``make demo``: the whole story on built-in sample data, end to end, on this machine.

1. generate a small class folder of synthetic JPEG/PNG images;
2. convert it with the Apache Beam job (embedded in-process runner) and verify it;
3. read it through the Loader and print the throughput;
4. start ``crossfeed serve`` in the background; pull batches from the stream with no model (the
   data plane's own rate), then train a PyTorch model from it while ``crossfeed mon`` watches,
   write ``crossfeed show``'s grid, stop the server cleanly;
5. train a Keras model under MirroredStrategy over two logical CPUs from the same dataset.

Each framework runs in a process of its own (TensorFlow and torch do not share one well).
Run: ``python -m crossfeed.demo OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = [sys.executable, "-m", "crossfeed.cli.main"]
STEPS = 300  # PyTorch steps, and batches pulled from the stream with no model before them


def _step(n: int, text: str) -> None:
    print(f"\n== {n}/5 {text}", flush=True)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$", " ".join(c if " " not in c else repr(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def _python_json(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; its last stdout line is JSON."""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text()
        if proc.poll() is not None:
            raise RuntimeError(f"crossfeed serve exited early with code {proc.returncode}")
        time.sleep(0.1)
    raise TimeoutError("crossfeed serve did not report its addresses in time")


def main(out: str = "demo_out") -> None:
    from crossfeed.beam_jobs.sample_data import make_image_folder
    from crossfeed.read.loader import Loader

    out_dir = Path(out).resolve()
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    images, dataset = out_dir / "images", out_dir / "dataset"

    _step(1, "generate a sample image folder (4 classes of coloured shapes)")
    files = make_image_folder(images, n_per_class=150, classes=4, size=32)
    print(f"wrote {len(files)} images under {images}")

    _step(2, "convert with Apache Beam (in-process runner), then verify")
    _run(
        CLI + ["convert", "images", str(images), str(dataset), "--splits", "train=0.8,validation=0.2", "--shards", "4"]
    )
    _run(CLI + ["info", str(dataset)])

    _step(3, "read the train split through the Loader")
    with Loader(dataset, split="train", batch_size=64, seed=0) as loader:
        start, n, first = time.perf_counter(), 0, None
        for _epoch in range(3):
            for batch in loader:
                n += len(batch["label"])
                first = first or time.perf_counter() - start
        secs = time.perf_counter() - start
    print(
        f"Loader: {n} samples in {secs:.2f} s = {n / secs:,.0f} samples/s (JPEG/PNG decoded, no model), "
        f"first batch after {(first or 0.0) * 1e3:.0f} ms"
    )

    _step(4, "serve over ZeroMQ; train PyTorch from the stream while `crossfeed mon` watches")
    tmp = Path(tempfile.mkdtemp(prefix="crossfeed-demo-"))
    endpoints = tmp / "endpoints"
    server = subprocess.Popen(
        CLI
        + [
            "serve",
            str(dataset),
            "tcp://127.0.0.1:0",
            "--broadcast",
            "tcp://127.0.0.1:0",
            "--batch-size",
            "32",
            "--epochs",
            "80",
            "--endpoint-file",
            str(endpoints),
        ]
    )
    try:
        addr, pub = _wait_for(endpoints, server).split()
        print(f"serving on {addr}, broadcasting on {pub}")
        # observers subscribe to the broadcast before training starts: they see the batches
        # the trainer pulls, and never take one from it
        grid = out_dir / "grid.png"
        mon = subprocess.Popen(CLI + ["mon", pub, "-c", "100"], stdout=subprocess.PIPE, text=True)
        show = subprocess.Popen(CLI + ["show", pub, "--skip", "20", "-o", str(grid)])
        time.sleep(1.0)
        # the same stream twice: first STEPS batches with no model (the data plane's own rate:
        # server decode + ZeroMQ + client), then STEPS batches into the PyTorch model
        result = _python_json(
            "import json, time, torch, crossfeed\n"
            "from crossfeed.adapters.torch_demo import train\n"
            # one intra-op thread: the server, `mon` and `show` share the cores, and torch's
            # spinning OpenMP threads on busy cores made the steps ~9x slower on a loaded 2-core machine
            "torch.set_num_threads(1)\n"
            f"with crossfeed.connect([{addr!r}]) as stream:\n"
            "    it, n, t = iter(stream), 0, time.perf_counter()\n"
            f"    for _ in range({STEPS}):\n"
            "        n += len(next(it)['label'])\n"
            "    alone = n / (time.perf_counter() - t)\n"
            f"    r = train(stream, steps={STEPS}, batch_size=32, num_classes=4, eval_source={str(dataset)!r})\n"
            "r['stream_samples_per_s'] = alone\n"
            "print(json.dumps(r))\n"
        )
        print(f"stream alone (no model): {STEPS} batches at {result['stream_samples_per_s']:,.0f} samples/s")
        print(
            f"PyTorch from the stream: {result['steps']} steps, accuracy {result['accuracy']:.3f} "
            f"(on the {result['accuracy_on']} split), {result['samples_per_s']:,.0f} samples/s (model included)"
        )
        for name, proc in (("crossfeed show", show), ("crossfeed mon", mon)):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                print(f"{name} saw too few batches and was stopped")
        mon_out = mon.stdout.read() if mon.stdout is not None else ""
        print("crossfeed mon (last lines):", *mon_out.strip().splitlines()[-3:], sep="\n  ")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"server stopped (exit {server.returncode}); image grid: {out_dir / 'grid.png'}")

    _step(5, "train Keras under MirroredStrategy (2 logical CPUs) from the same dataset")
    if os.environ.get("CROSSFEED_DEMO_SKIP_TF"):
        print("skipped (CROSSFEED_DEMO_SKIP_TF is set)")
    else:
        r = _python_json(
            "import json\n"
            "from crossfeed.adapters.tf_demo import train_keras_demo\n"
            f"print(json.dumps(train_keras_demo({str(dataset)!r}, steps=200, batch_size=64)))\n"
        )
        print(f"Keras: accuracy {r['accuracy']:.3f}, {r['samples_per_s']:,.0f} samples/s (model included)")
    print(f"\ndemo done: everything is under {out_dir}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
