"""crossfeed: convert a dataset once, read it from TensorFlow and PyTorch, serve it over the network.

The public surface is the names below; everything else lives in submodules. Importing crossfeed
never imports tensorflow, torch or apache_beam, and imports nothing heavy at all until a name is
used: the errors are here at once, every other name (the Loader, the options, the Dataset, the
writer, the network plane) is imported on first use (`__getattr__`), so that a program built on
crossfeed — the ``crossfeed`` CLI first of all — runs its own first lines (its Ctrl-C handler)
before numpy and the rest load.
"""

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from crossfeed.format.schema import Encoding, Feature, Schema
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
    from crossfeed.read.sources.dataset import Dataset, Split, open_dataset
    from crossfeed.write.options import WriteOptions

__version__ = "0.1.0"


def write_dataset(path, samples, **options) -> "Dataset":
    """Write ``samples`` as a split of the dataset at ``path`` and return it opened: the options
    (a `WriteOptions`, whole as ``options=`` or as its fields: ``shard_size="64MB"`` …) and the
    atomic commit are `crossfeed.write.writer.write_samples`'s. ``path`` may be any fsspec URL the
    read side reads, reached with ``storage_options=`` (docs/storage.md)."""
    from crossfeed.read.sources.dataset import open_dataset
    from crossfeed.write.writer import write_samples

    where = write_samples(path, samples, **options)
    return open_dataset(where, storage_options=options.get("storage_options"))


# Imported on first use, so `import crossfeed` stays light (the network plane pulls in pyzmq).
_LAZY = {
    "Encoding": "crossfeed.format.schema",
    "Feature": "crossfeed.format.schema",
    "Schema": "crossfeed.format.schema",
    "Loader": "crossfeed.read.loader",
    "Pipeline": "crossfeed.read.pipeline",
    "WriteOptions": "crossfeed.write.options",
    "LoaderOptions": "crossfeed.read.options",
    "Pack": "crossfeed.read.options",
    "PlanOptions": "crossfeed.read.options",
    "ReadOptions": "crossfeed.read.options",
    "Remainder": "crossfeed.read.options",
    "ShardOptions": "crossfeed.read.options",
    "Shuffle": "crossfeed.read.options",
    "Source": "crossfeed.read.options",
    "Dataset": "crossfeed.read.sources.dataset",
    "Split": "crossfeed.read.sources.dataset",
    "open_dataset": "crossfeed.read.sources.dataset",
    "write_samples": "crossfeed.write.writer",
    "connect": "crossfeed.net.connect",
    "Client": "crossfeed.net.stream.client",
    "ClientKeys": "crossfeed.net.keys",
    "BatchMeta": "crossfeed.format.wire",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next use is a plain lookup
        return value
    raise AttributeError(f"module 'crossfeed' has no attribute {name!r}")


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
    "Schema",
    "SchemaError",
    "ServerLostError",
    "ShardOptions",
    "Shuffle",
    "Source",
    "Split",
    "SplitNotFoundError",
    "WireError",
    "WorkerError",
    "WriteOptions",
    "connect",
    "open_dataset",
    "write_dataset",
]
