"""crossfeed: convert a dataset once, read it from TensorFlow and PyTorch, serve it over the network.

The public surface is the names below; everything else lives in submodules. Importing crossfeed
never imports tensorflow, torch or apache_beam.
"""

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
from crossfeed.read.sources.dataset import Dataset, Split, open_dataset
from crossfeed.write.options import WriteOptions
from crossfeed.write.writer import write_samples

__version__ = "0.1.0"


def write_dataset(path, samples, **options) -> Dataset:
    """Write ``samples`` as a split of the dataset at ``path`` and return it opened: the options
    (a `WriteOptions`, whole as ``options=`` or as its fields: ``shard_size="64MB"`` …) and the
    atomic commit are `crossfeed.write.writer.write_samples`'s."""
    return open_dataset(write_samples(path, samples, **options))


# The network plane pulls in pyzmq: imported on first use, so `import crossfeed` stays light.
_LAZY = {
    "connect": "crossfeed.net.connect",
    "Client": "crossfeed.net.stream.client",
    "ClientKeys": "crossfeed.net.keys",
    "BatchMeta": "crossfeed.format.wire",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
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
