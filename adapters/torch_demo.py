"""A tiny PyTorch training run over a crossfeed image dataset (what ``make demo`` shows).

``train(source)`` reads images and labels through `TorchDataset` (the Loader decodes the JPEG/PNG
bytes and a per-sample transform resizes them to one size in its threads), trains a small CNN for
``steps`` steps and returns ``{"accuracy", "samples_per_s", ...}``. ``source`` is a dataset path
or a ``crossfeed.connect(...)`` stream of batches with the same keys.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from crossfeed.adapters.torch import TorchDataset, is_stream
from crossfeed.errors import ConfigError
from crossfeed.read.sources.dataset import open_dataset

log = logging.getLogger(__name__)
EVAL_SPLITS = ("test", "validation", "val", "eval")


class ResizeImage:
    """Per-sample transform: the image feature as uint8 ``(size, size, 3)`` (grey and alpha
    handled), so a batch of images of different sizes stacks into one array. Picklable."""

    def __init__(self, key: str, size: int):
        self.key, self.size = key, int(size)

    def __call__(self, sample: dict) -> dict:
        sample = dict(sample)
        sample[self.key] = fit_image(np.asarray(sample[self.key]), self.size)
        return sample


def fit_image(img: np.ndarray, size: int) -> np.ndarray:
    from PIL import Image

    if img.ndim == 2:
        img = img[:, :, None]
    if img.shape[2] == 1:
        img = np.repeat(img, 3, axis=2)
    img = np.ascontiguousarray(img[:, :, :3], dtype=np.uint8)
    if img.shape[:2] != (size, size):
        img = np.asarray(Image.fromarray(img).resize((size, size), Image.Resampling.BILINEAR))
    return img


def tiny_cnn(num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveMaxPool2d(1),
        nn.Flatten(),
        nn.Linear(64, num_classes),
    )


def _inputs(images, size: int) -> torch.Tensor:
    """A batch of images (uint8 NHWC tensor, or a list of HWC images) → float NCHW in [0, 1]."""
    if isinstance(images, list):
        images = torch.from_numpy(np.stack([fit_image(np.asarray(i), size) for i in images]))
    x = images.permute(0, 3, 1, 2).float().div_(255.0)
    if x.shape[-2:] != (size, size):
        x = nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x


def _num_classes(ds: TorchDataset, split: str, label_key: str) -> int:
    dataset = ds.loader.dataset
    classes = dataset.metadata.get("classes")
    if isinstance(classes, (list, tuple)) and classes:
        return len(classes)
    top = dataset[split].info.statistics.get(label_key, {}).get("max")
    if top is None:
        raise ConfigError(f"cannot tell the number of classes of {label_key!r}: pass num_classes=")
    return int(top) + 1


def _batches(ds: TorchDataset, loader: DataLoader, stream: bool):
    """Batches for as long as asked: epoch after epoch for a dataset, the stream as it comes."""
    epoch = 0
    while True:
        if not stream:
            ds.set_epoch(epoch)
        got = 0
        for batch in loader:
            got += 1
            yield batch
        if stream or not got:
            return
        epoch += 1


def train(
    source,
    *,
    split: str = "train",
    steps: int = 300,
    batch_size: int = 32,
    image_key: str = "image",
    label_key: str = "label",
    image_size: int = 32,
    num_classes: int | None = None,
    num_workers: int = 0,
    lr: float = 3e-3,
    seed: int = 0,
    eval_source=None,
) -> dict:
    """Train a tiny CNN for ``steps`` steps; returns ``accuracy`` (on a held-out split of the
    dataset when it has one — test/validation/val/eval — else on the last tenth of the training
    batches, as ``accuracy_on`` says), ``samples_per_s`` (data loading and training together),
    ``steps`` and ``final_loss``. A model trained from a stream is evaluated on ``eval_source``'s
    held-out split when given (a dataset path)."""
    if steps < 1 or batch_size < 1 or image_size < 8:
        raise ConfigError(
            f"steps and batch_size must be >= 1 and image_size >= 8, got {steps}, {batch_size}, {image_size}"
        )
    torch.manual_seed(seed)
    stream = is_stream(source)
    resize = ResizeImage(image_key, image_size)
    ds = (
        TorchDataset(source)
        if stream
        else TorchDataset(
            source, split=split, batch_size=batch_size, seed=seed, features=[image_key, label_key], transform=resize
        )
    )
    if num_classes is None:
        if stream:
            raise ConfigError("a stream does not say how many classes there are: pass num_classes=")
        num_classes = _num_classes(ds, split, label_key)
    model = tiny_cnn(num_classes)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loader = DataLoader(
        ds, batch_size=None, num_workers=0 if stream else num_workers, persistent_workers=num_workers > 0 and not stream
    )
    tail = max(1, steps // 10)
    done = seen = correct = counted = 0
    loss = torch.zeros(())
    start = time.perf_counter()
    for batch in _batches(ds, loader, stream):
        x, y = _inputs(batch[image_key], image_size), torch.as_tensor(batch[label_key]).long().view(-1)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        done, seen = done + 1, seen + len(y)
        if done > steps - tail:
            correct += int((logits.argmax(1) == y).sum())
            counted += len(y)
        if done == steps:
            break
    elapsed = time.perf_counter() - start
    result = {
        "steps": done,
        "samples_per_s": seen / elapsed if elapsed > 0 else float("inf"),
        "final_loss": float(loss.detach()),
        "accuracy": correct / max(1, counted),
        "accuracy_on": f"{split} (last {tail} steps)",
    }
    target = eval_source if stream else source
    if target is not None:
        with open_dataset(target) as dataset:
            held_out = [s for s in EVAL_SPLITS if s != split and s in dataset]
        if held_out:
            result["accuracy"], result["accuracy_on"] = (
                _evaluate(model, target, held_out[0], batch_size, resize, image_key, label_key, image_size),
                held_out[0],
            )
    ds.close()
    log.info(
        "trained %d steps: accuracy %.3f on %s, %.0f samples/s",
        done,
        result["accuracy"],
        result["accuracy_on"],
        result["samples_per_s"],
    )
    return result


@torch.no_grad()
def _evaluate(model, source, split, batch_size, resize, image_key, label_key, image_size) -> float:
    model.eval()
    correct = total = 0
    with TorchDataset(
        source,
        split=split,
        batch_size=batch_size,
        shuffle="none",
        features=[image_key, label_key],
        transform=resize,
        rank=0,
        world_size=1,
    ) as ds:
        for batch in ds:
            y = batch[label_key].long().view(-1)
            correct += int((model(_inputs(batch[image_key], image_size)).argmax(1) == y).sum())
            total += len(y)
    model.train()
    return correct / max(1, total)
