"""Does crossfeed keep one GPU busy? A short check (well under 5 minutes on one GPU).

    python benchmarks/gpu_check.py [--seconds 10] [--batch-size 256] [--json out.json]

Writes a small image dataset (64x64x3 uint8 + label) in a temporary folder, then for each of
torch and JAX that can see a GPU:
  1. host -> device throughput: one 64 MiB array, pinned (torch: `pin_memory()`; JAX:
     `jax.device_put` of a NumPy array, which stages through its own pinned buffers), GB/s;
  2. a small CNN's training step time fed by crossfeed (`TorchDataset` + `StatefulLoader` with
     pinned memory and 4 workers; `JaxLoader`), against the same step on one synthetic batch
     already on the device;
  3. the verdict: the input keeps the device busy when the crossfeed-fed step is within 10% of
     the synthetic one (the device, not the input, sets the pace).
Without a GPU (or without torch / JAX) it says so for each and exits 0: it runs anywhere, and
measures only where there is a device. Prints one line per measurement and, with --json, writes
them (with the device's name) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUSY = 1.10  # fed step / synthetic step at most this: the input keeps the device busy
H2D_BYTES = 64 << 20


def write_images(path: Path, n: int) -> None:
    import crossfeed

    rnd = np.random.default_rng(0)
    samples = (
        {"image": rnd.integers(0, 255, (64, 64, 3), dtype=np.uint8), "label": np.int64(i % 10)} for i in range(n)
    )
    crossfeed.write_dataset(str(path), samples, num_shards=8).close()


def _timed(step, batches, seconds: float) -> tuple[float, int]:
    """Mean seconds per step over `seconds` (after 5 warm-up steps), and the steps taken."""
    it = iter(batches)
    for _ in range(5):
        step(next(it))
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step(next(it))
        n += 1
    return (time.perf_counter() - start) / max(n, 1), n


def check_torch(data: Path, args, out: dict) -> None:
    try:
        import torch
    except ImportError:
        print("torch: not installed, skipped")
        return
    if not torch.cuda.is_available():
        print("torch: no GPU (torch.cuda.is_available() is False), skipped")
        out["torch"] = "no GPU"
        return
    from crossfeed.adapters.torch import StatefulLoader, TorchDataset

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    host = torch.empty(H2D_BYTES, dtype=torch.uint8).pin_memory()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        host.to(dev, non_blocking=True)
    torch.cuda.synchronize()
    h2d = 10 * H2D_BYTES / (time.perf_counter() - t0) / 1e9
    print(f"torch on {name}: host->device, pinned: {h2d:.1f} GB/s")
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(64, 10),
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch):
        x = batch["image"].to(dev, non_blocking=True).permute(0, 3, 1, 2).float().div_(255)
        y = batch["label"].to(dev, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()  # wait for the device: each step's time is the device's and the input's

    synthetic = {
        "image": torch.randint(0, 255, (args.batch_size, 64, 64, 3), dtype=torch.uint8, device=dev),
        "label": torch.randint(0, 10, (args.batch_size,), device=dev),
    }

    def forever():
        while True:
            yield synthetic

    synth, _ = _timed(step, forever(), args.seconds)
    ds = TorchDataset(str(data), batch_size=args.batch_size, seed=0)
    loader = StatefulLoader(ds, num_workers=4, pin_memory=True, persistent_workers=True)

    def epochs():
        e = 0
        while True:
            ds.set_epoch(e)
            yield from loader
            e += 1

    fed, n = _timed(step, epochs(), args.seconds)
    busy = fed <= BUSY * synth
    print(
        f"torch on {name}: step {1000 * synth:.2f} ms on synthetic device data, {1000 * fed:.2f} ms fed by crossfeed "
        f"({n} steps, {args.batch_size / fed:,.0f} samples/s): the input {'keeps' if busy else 'does NOT keep'} the device busy"
    )
    out["torch"] = {
        "device": name,
        "h2d_pinned_gbps": h2d,
        "step_synthetic_ms": 1000 * synth,
        "step_fed_ms": 1000 * fed,
        "busy": busy,
    }


def check_jax(data: Path, args, out: dict) -> None:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("jax: not installed, skipped")
        return
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        print(f"jax: no GPU (devices: {', '.join(d.platform for d in jax.devices())}), skipped")
        out["jax"] = "no GPU"
        return
    from crossfeed.adapters.jax import JaxLoader

    name = gpus[0].device_kind
    host = np.ones(H2D_BYTES, np.uint8)
    jax.device_put(host, gpus[0]).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        jax.device_put(host, gpus[0]).block_until_ready()
    h2d = 10 * H2D_BYTES / (time.perf_counter() - t0) / 1e9
    print(f"jax on {name}: host->device: {h2d:.1f} GB/s")
    key = jax.random.PRNGKey(0)
    params = {
        "w1": jax.random.normal(key, (3, 3, 3, 32)) * 0.1,
        "w2": jax.random.normal(key, (3, 3, 32, 64)) * 0.1,
        "w3": jax.random.normal(key, (64, 10)) * 0.1,
    }

    def loss_fn(p, image, label):
        x = image.astype(jnp.float32) / 255
        x = jax.nn.relu(
            jax.lax.conv_general_dilated(x, p["w1"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        )
        x = jax.nn.relu(
            jax.lax.conv_general_dilated(x, p["w2"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        )
        logits = x.mean(axis=(1, 2)) @ p["w3"]
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(label.shape[0]), label])

    @jax.jit
    def update(p, image, label):
        g = jax.grad(loss_fn)(p, image, label)
        return jax.tree_util.tree_map(lambda a, b: a - 0.01 * b, p, g)

    state = {"p": params}

    def step(batch):
        state["p"] = update(state["p"], batch["image"], batch["label"])
        jax.block_until_ready(state["p"])

    synthetic = {
        "image": jax.device_put(np.random.randint(0, 255, (args.batch_size, 64, 64, 3), np.uint8), gpus[0]),
        "label": jax.device_put(np.random.randint(0, 10, (args.batch_size,)).astype(np.int32), gpus[0]),
    }

    def forever():
        while True:
            yield synthetic

    synth, _ = _timed(step, forever(), args.seconds)
    loader = JaxLoader(str(data), batch_size=args.batch_size, seed=0)

    def epochs():
        for batch in loader.epochs(1 << 20):
            yield {"image": batch["image"], "label": batch["label"].astype(jnp.int32)}

    fed, n = _timed(step, epochs(), args.seconds)
    busy = fed <= BUSY * synth
    print(
        f"jax on {name}: step {1000 * synth:.2f} ms on synthetic device data, {1000 * fed:.2f} ms fed by crossfeed "
        f"({n} steps, {args.batch_size / fed:,.0f} samples/s): the input {'keeps' if busy else 'does NOT keep'} the device busy"
    )
    out["jax"] = {
        "device": name,
        "h2d_gbps": h2d,
        "step_synthetic_ms": 1000 * synth,
        "step_fed_ms": 1000 * fed,
        "busy": busy,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="timed seconds per step measurement")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out: dict = {"date": time.strftime("%Y-%m-%d", time.gmtime())}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "images"
        needed = False
        try:
            import torch

            needed |= torch.cuda.is_available()
        except ImportError:
            pass
        try:
            import jax

            needed |= any(d.platform == "gpu" for d in jax.devices())
        except ImportError:
            pass
        if needed:
            write_images(data, args.samples)
        check_torch(data, args, out)
        check_jax(data, args, out)
    if not any(isinstance(v, dict) for v in out.values()):
        print("no GPU: nothing measured (run this on a machine with one)")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
