"""crossfeed: convert a dataset once, read it from TensorFlow and PyTorch, serve it over the network.

The public surface is the names below; everything else lives in submodules. Importing crossfeed
never imports tensorflow, torch or apache_beam, and imports no submodule until one of its names is
first used: ``import crossfeed.errors`` (what every worker process and CLI start pays) loads the
errors module alone, not the Loader, the writer and the network plane behind the other names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names as a type checker (and a reader) sees them; at run time: `_LAZY`
    from crossfeed.errors import (
        ConfigError,
        CorruptRecordError,
        CrossfeedError,
        DatasetNotFoundError,
        DatasetRewrittenError,
        ExampleError,
        IndexFileError,
        ManifestError,
        RemoteError,
        RootNotAllowedError,
        SchemaError,
        ServerLostError,
        SplitNotFoundError,
        WireError,
        WorkerError,
    )
    from crossfeed.format.schema import Encoding, Feature, Schema
    from crossfeed.format.weights import balanced
    from crossfeed.format.wire import BatchMeta
    from crossfeed.net.connect import connect
    from crossfeed.net.keys import ClientKeys
    from crossfeed.net.stream.client import Client
    from crossfeed.read.loader import Loader
    from crossfeed.read.options import (
        LoaderOptions,
        Pack,
        PlanOptions,
        ReadOptions,
        Remainder,
        ShardOptions,
        Shuffle,
        Source,
    )
    from crossfeed.read.pipeline import Pipeline
    from crossfeed.read.schedule import Schedule
    from crossfeed.read.skips import Skip
    from crossfeed.read.sources.dataset import Dataset, Split, open_dataset
    from crossfeed.read.stages.recipes import batch_rng, sample_rng, with_rng
    from crossfeed.read.tools.filter_pass import filter_pass
    from crossfeed.read.tools.weights import write_weights
    from crossfeed.write.options import WriteOptions

__version__ = "0.1.0"


def write_dataset(path, samples, **options) -> Dataset:
    """Write ``samples`` as a split of the dataset at ``path`` and return it opened: the options
    (a `WriteOptions`, whole as ``options=`` or as its fields: ``shard_size="64MB"`` …) and the
    atomic commit are `crossfeed.write.writer.write_samples`'s. ``path`` may be any fsspec URL the
    read side reads, reached with ``storage_options=`` (docs/storage.md)."""
    from crossfeed.read.sources.dataset import open_dataset
    from crossfeed.write.writer import write_samples

    where = write_samples(path, samples, **options)
    return open_dataset(where, storage_options=options.get("storage_options"))


# Each public name and the module that defines it, imported on the name's first use (PEP 562), so
# `import crossfeed` and `import crossfeed.errors` stay light (the network plane would pull in pyzmq,
# the Loader numpy and the whole read side).
_LAZY = {
    **dict.fromkeys(
        (
            "ConfigError",
            "CorruptRecordError",
            "CrossfeedError",
            "DatasetNotFoundError",
            "DatasetRewrittenError",
            "ExampleError",
            "IndexFileError",
            "ManifestError",
            "RemoteError",
            "RootNotAllowedError",
            "SchemaError",
            "ServerLostError",
            "SplitNotFoundError",
            "WireError",
            "WorkerError",
        ),
        "crossfeed.errors",
    ),
    **dict.fromkeys(("Encoding", "Feature", "Schema"), "crossfeed.format.schema"),
    **dict.fromkeys(
        ("LoaderOptions", "Pack", "PlanOptions", "ReadOptions", "Remainder", "ShardOptions", "Shuffle", "Source"),
        "crossfeed.read.options",
    ),
    **dict.fromkeys(("Dataset", "Split", "open_dataset"), "crossfeed.read.sources.dataset"),
    "Loader": "crossfeed.read.loader",
    "Pipeline": "crossfeed.read.pipeline",
    "Schedule": "crossfeed.read.schedule",
    "WriteOptions": "crossfeed.write.options",
    "connect": "crossfeed.net.connect",
    "Client": "crossfeed.net.stream.client",
    "ClientKeys": "crossfeed.net.keys",
    "BatchMeta": "crossfeed.format.wire",
    "balanced": "crossfeed.format.weights",
    "write_weights": "crossfeed.read.tools.weights",
    "filter_pass": "crossfeed.read.tools.filter_pass",
    "Skip": "crossfeed.read.skips",
    **dict.fromkeys(("batch_rng", "sample_rng", "with_rng"), "crossfeed.read.stages.recipes"),
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once: later uses are a plain attribute
        return value
    raise AttributeError(f"module 'crossfeed' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "BatchMeta",
    "Client",
    "ClientKeys",
    "ConfigError",
    "CorruptRecordError",
    "CrossfeedError",
    "Dataset",
    "DatasetNotFoundError",
    "DatasetRewrittenError",
    "Encoding",
    "ExampleError",
    "Feature",
    "IndexFileError",
    "Loader",
    "LoaderOptions",
    "ManifestError",
    "Pack",
    "Pipeline",
    "PlanOptions",
    "ReadOptions",
    "Remainder",
    "RemoteError",
    "RootNotAllowedError",
    "Schedule",
    "Schema",
    "SchemaError",
    "ServerLostError",
    "ShardOptions",
    "Shuffle",
    "Skip",
    "Source",
    "Split",
    "SplitNotFoundError",
    "WireError",
    "WorkerError",
    "WriteOptions",
    "balanced",
    "batch_rng",
    "connect",
    "filter_pass",
    "open_dataset",
    "sample_rng",
    "with_rng",
    "write_dataset",
    "write_weights",
]
