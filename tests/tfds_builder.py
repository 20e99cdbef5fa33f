"""A tiny TFDS dataset built by tensorflow-datasets itself, offline (run as a script, in a process of
its own, so that the test process never imports TensorFlow):

    python tests/tfds_builder.py DATA_DIR EXPECTED.pkl

prepares it under DATA_DIR (several shards per split) and pickles what ``tfds.as_numpy`` reads
back from each split, in file order, as ``{"data_dir": ..., "splits": {split: [flat sample]}}``
with nested feature names joined by ``/`` (the keys TFDS writes into each Example)."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import tensorflow_datasets as tfds

SIZES = {"train": 23, "test": 7}


class TinyTfds(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        f = tfds.features
        return tfds.core.DatasetInfo(
            builder=self,
            features=f.FeaturesDict(
                {
                    "image": f.Image(shape=(None, None, 3)),
                    "mask": f.Image(shape=(6, 5, 1)),
                    "label": f.ClassLabel(names=["cat", "dog", "bird"]),
                    "embedding": f.Tensor(shape=(4,), dtype=np.float32),
                    "patch": f.Tensor(shape=(2, 3), dtype=np.uint8, encoding="bytes"),
                    "counts": f.Tensor(shape=(3,), dtype=np.int32),
                    "caption": f.Text(),
                    "flag": f.Scalar(dtype=np.bool_),
                    "tokens": f.Sequence(f.Tensor(shape=(), dtype=np.int64)),
                    "meta": {
                        "weight": np.float64,
                        "pair": f.Sequence(np.int64, length=2),
                        "kind": f.ClassLabel(names=["a", "b"]),
                    },
                }
            ),
        )

    def _split_generators(self, dl_manager):
        return {name: self._generate_examples(n, seed) for seed, (name, n) in enumerate(SIZES.items())}

    def _generate_examples(self, n, seed):
        rng = np.random.default_rng(seed)
        for i in range(n):
            yield (
                f"{seed}-{i}",
                {
                    "image": rng.integers(0, 256, (5 + i % 4, 7, 3), dtype=np.uint8),
                    "mask": rng.integers(0, 2, (6, 5, 1), dtype=np.uint8) * 255,
                    "label": i % 3,
                    "embedding": rng.standard_normal(4).astype(np.float32),
                    "patch": rng.integers(0, 256, (2, 3), dtype=np.uint8),
                    "counts": np.array([i, -i, 1 << 20], np.int32),
                    "caption": f"sample {i} of split {seed}: é ü",
                    "flag": bool(i % 2),
                    "tokens": list(range(i % 5)),
                    "meta": {"weight": i / 3, "pair": [i, -i], "kind": i % 2},
                },
            )


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


def main(data_dir: str, out: str) -> None:
    builder = TinyTfds(data_dir=data_dir)
    # Three shards per split, so that a split spans several files.
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=3))
    splits = {s: [_flat(x) for x in tfds.as_numpy(builder.as_dataset(split=s, shuffle_files=False))] for s in SIZES}
    with open(out, "wb") as f:
        pickle.dump({"data_dir": str(builder.data_dir), "splits": splits}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
