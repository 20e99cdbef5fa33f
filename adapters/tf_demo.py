"""``make demo``'s TensorFlow half: a tiny Keras classifier trained on a crossfeed dataset under
MirroredStrategy over logical CPU devices, fed by `crossfeed.adapters.tf.input_fn`: a small CNN
when the dataset has an image feature, else an MLP on its fixed-shape numeric features.

Call `train_keras_demo` in a fresh process (logical devices must be configured before TensorFlow
starts its runtime); ``python -m crossfeed.adapters.tf_demo DATASET`` prints its result as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import tensorflow as tf

from crossfeed.adapters import tf as cftf
from crossfeed.adapters import tf_spec
from crossfeed.errors import ConfigError
from crossfeed.format import codecs
from crossfeed.read.sources.dataset import open_dataset


def logical_cpus(n: int) -> list[str]:
    """Split the CPU into ``n`` logical devices (if TensorFlow has not started yet) and name them."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError:
        pass  # the runtime already started: use the devices it has
    return [d.name for d in tf.config.list_logical_devices("CPU")][:n]


def _inputs(ds, split: str, label: str) -> dict:
    """``{feature: (lo, hi, shape)}``: what the model sees (numbers and images), the value range
    it is scaled from and, for images whose shape varies, the commonest shape in the statistics
    (the batch is padded or cropped to it)."""
    stats = ds.splits[split].statistics
    feats = {}
    for f in ds.schema:
        s = stats.get(f.name, {})
        if f.name == label or f.codec.text:
            continue
        shape = tf_spec.item_shape(f)
        if f.codec.image:
            if None in shape and s.get("shapes"):
                shape = tuple(int(d) for d in max(s["shapes"], key=s["shapes"].get).split("x"))
            if None not in shape:
                feats[f.name] = (0.0, 255.0, shape)
        elif None not in shape:
            feats[f.name] = (float(s.get("min", 0.0)), float(s.get("max", 1.0)), shape)
    if not feats:
        raise ConfigError(f"{ds.path}: no fixed-shape numeric or image feature besides {label!r} to learn from")
    return feats


def train_keras_demo(
    dataset_path,
    *,
    steps: int = 100,
    batch_size: int = 64,
    split: str = "train",
    label: str = "label",
    num_devices: int = 2,
    seed: int = 0,
    epochs: int = 2,
    eval_split: str | None = None,
) -> dict:
    """Train for ``epochs`` × ``steps`` steps of global batch ``batch_size``; returns
    ``dict(accuracy=..., accuracy_on=split, loss=[first epoch, last epoch], samples_per_s=..., replicas=...)``.
    Accuracy is measured on ``eval_split`` (default: "validation" or "test" if the dataset has
    one, else the training split); samples/s is over the epochs after the first (which traces)."""
    import keras

    devices = logical_cpus(num_devices)
    ds = open_dataset(dataset_path)
    if label not in ds.schema.names or ds.schema[label].codec is not codecs.INT64:
        raise ConfigError(f"{ds.path}: the demo needs an int64 class feature {label!r}; pass label=")
    num_classes = int(ds.splits[split].statistics.get(label, {}).get("max", 1)) + 1
    scales = _inputs(ds, split, label)

    image = next((k for k in scales if ds.schema[k].codec.image), None)
    if image is not None:  # a small CNN on the image alone
        scales = {image: scales[image]}

    def to_xy(batch):
        parts = []
        for k, (lo, hi, shape) in scales.items():
            x = batch[k]
            if isinstance(x, tf.RaggedTensor):  # images of varying shape: pad or crop to one
                x = x.to_tensor(shape=[None, *shape])
            x = (tf.cast(x, tf.float32) - (hi + lo) / 2) / max((hi - lo) / 2, 1e-6)  # to [-1, 1]
            if image is not None:
                return tf.ensure_shape(x, [None, *shape]), batch[label]
            parts.append(tf.reshape(x, [-1, int(np.prod(shape, dtype=np.int64))]))
        return tf.concat(parts, axis=1), batch[label]

    strategy = tf.distribute.MirroredStrategy(devices)
    fn = cftf.input_fn(ds, split=split, global_batch_size=batch_size, seed=seed, repeat=True, features=[*scales, label])
    data = strategy.distribute_datasets_from_function(lambda ctx: fn(ctx).map(to_xy))
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        L = keras.layers
        body = (
            [
                L.Conv2D(16, 3, activation="relu"),
                L.MaxPooling2D(),
                L.Conv2D(32, 3, activation="relu"),
                L.GlobalAveragePooling2D(),
            ]
            if image is not None
            else []
        )
        model = keras.Sequential(body + [L.Dense(64, activation="relu"), L.Dense(num_classes)])
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    first = model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)  # includes tracing
    t0 = time.perf_counter()
    rest = model.fit(data, steps_per_epoch=steps, epochs=max(1, epochs - 1), verbose=0, shuffle=False)
    elapsed = time.perf_counter() - t0
    eval_split = eval_split or next((s for s in ("validation", "test") if s in ds.splits), split)
    eval_data = cftf.dataset(
        ds, split=eval_split, batch_size=batch_size, shuffle="none", drop_last=False, features=[*scales, label]
    ).map(to_xy)
    options = tf.data.Options()  # the dataset knows its exact cardinality: Keras counts no phantom batch
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF  # one worker
    eval_data = eval_data.with_options(options)
    _, accuracy = model.evaluate(eval_data, verbose=0)
    return {
        "accuracy": float(accuracy),
        "accuracy_on": eval_split,
        "loss": [float(first.history["loss"][0]), float(rest.history["loss"][-1])],
        "samples_per_s": steps * max(1, epochs - 1) * batch_size / elapsed,
        "replicas": strategy.num_replicas_in_sync,
    }


if __name__ == "__main__":
    given: dict[str, Any] = {k: int(v) for k, v in (a.split("=") for a in sys.argv[2:])}
    print(json.dumps(train_keras_demo(sys.argv[1], **given)))
