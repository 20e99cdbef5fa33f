"""One table of Loader options for every front end's options test: values that differ from every
default, values every front end must refuse, and where each option lands in a built Loader."""

from __future__ import annotations

import numpy as np

import crossfeed
from crossfeed.io.storage import read_deadline
from crossfeed.read.loader import Loader
from crossfeed.read.options import LoaderOptions

# every field a front end passes through, each away from its default
CHANGED = dict(
    split="val",
    batch_size=3,
    shuffle="block",
    seed=7,
    drop_last=True,
    remainder="drop",
    block_shards=2,
    num_threads=3,
    prefetch=1,
    decode_images=False,
    on_error="skip",
    max_skips=5,
    rank=1,
    world_size=2,
    features=["x"],
    return_index=True,
    read_timeout=5,
    storage_options={"anon": True, "client_kwargs": {"region_name": "eu-west-1"}},
    log_stats=True,
)

# (field, value) pairs every front end refuses with the same ConfigError
BAD = [
    ("batch_size", 0),
    ("shuffle", "sideways"),
    ("seed", -1),
    ("seed", None),  # the plan is a pure function of the seed: no front end picks a fresh order
    ("num_threads", -1),
    ("prefetch", -1),
    ("block_shards", 0),
    ("remainder", "keep"),
    ("on_error", "maybe"),
    ("max_skips", -2),
    ("cache_limit", "lots"),
    ("rank", 2),
    ("read_timeout", -1),
    ("storage_options", ["anon", "true"]),
    ("image_size", "0x4"),
    ("channels", 2),
    ("resize", "squash"),
    ("log_stats", "yes"),
    ("batch_by_tokens", 0),
    ("pack", {"length": 0}),
]

# the token options (a token dataset: `write_token_data`), away from their defaults; and the flags that say the same
PACKED = dict(pack={"length": 16, "features": ["tokens"], "split": "rows"})
PACKED_FLAGS = ["--pack-length", "16", "--pack-features", "tokens", "--pack-split", "rows"]
BY_TOKENS = dict(batch_by_tokens=64)

# the image options, away from their defaults (they need decoded images: CHANGED turns decoding off)
IMAGES = dict(image_size=(5, 4), channels=3, resize="pad")


def write(root) -> str:
    """A two-split dataset the options above can read."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("val", 30)):
        samples = [{"x": rng.random(4, dtype=np.float32), "y": i} for i in range(n)]
        crossfeed.write_dataset(root, samples, split=split, num_shards=3, add_split=split != "train").close()
    return str(root)


def write_token_data(root) -> str:
    """A token dataset with lengths files (what `PACKED` and `BY_TOKENS` read)."""
    from token_data import write_tokens

    return write_tokens(root, [3, 17, 9, 30, 1, 12, 20, 5])


def landed_tokens(loader: Loader) -> dict:
    """Where the token options land: the plan (`PackSampler`) and the builder's packed features."""
    return {
        "sampler": type(loader.pipeline.sampler).__name__,
        "pack": loader.pipeline.sampler.pack,
        "budget": loader.pipeline.sampler.budget,
        "features": [name for name, _ in loader.pipeline.builder.features],
    }


def expected_tokens(options: LoaderOptions) -> dict:
    plan = options.plan
    return {
        "sampler": "PackSampler",
        "pack": plan.pack,
        "budget": plan.batch_by_tokens,
        "features": list(plan.pack.features if plan.pack else ("tokens",)),
    }


def landed(loader: Loader) -> dict:
    """Each option as the stage that uses it holds it: the sampler (plan and share), the split
    and decoder (what is read), the executor and its window (how hard), the error budget."""
    reader = loader.pipeline.builder.reader
    executor = loader.pipeline.executor
    return {
        "plan": loader.pipeline.sampler.options,
        "shard": loader.pipeline.sampler.shard,
        "split": loader.split.name if loader.split is not None else None,
        "features": tuple(f.name for f in reader.decoder.features),
        "decode_images": reader.decoder.decode_images,
        "image_fit": getattr(reader.decoder, "fit", None),
        "return_index": loader.pipeline.builder.return_index,
        "threads": executor.num_threads,
        "window": executor.window,
        "skips": None if loader.pipeline.builder.budget is None else loader.pipeline.builder.budget.max_skips,
        "read_timeout": loader.dataset.index_storage.read_timeout,
        "storage_options": loader.dataset.storage.storage_options,
        "log_stats": loader.options.read.log_stats,  # read by `Loader.__iter__` at each epoch's end
    }


def expected(options: LoaderOptions) -> dict:
    """What `landed` reads off a Loader built from ``options`` (a transform keeps its threads)."""
    return {
        "plan": options.plan,
        "shard": options.shard,
        "split": options.split,
        "features": tuple(options.features or ("x", "y")),
        "decode_images": options.read.decode_images,
        "image_fit": options.read.image_fit,
        "return_index": options.return_index,
        "threads": options.read.num_threads,
        "window": max(1, options.read.num_threads + options.read.prefetch),
        "skips": options.read.max_skips if options.read.on_error.value == "skip" else None,
        "read_timeout": read_deadline(options.read.read_timeout),
        "storage_options": options.read.storage_options,
        "log_stats": options.read.log_stats,
    }


def keep(sample: dict) -> dict:
    """A module-level transform: with one, the Loader builds batches in its threads."""
    return sample
