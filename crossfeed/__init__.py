"""crossfeed: convert a dataset once, read it from TensorFlow and PyTorch, serve it over the network.

The public surface is the names below; everything else lives in submodules. Importing crossfeed
never imports tensorflow, torch or apache_beam.
"""

from crossfeed.errors import (
    ConfigError,
    CorruptRecordError,
    CrossfeedError,
    DatasetNotFoundError,
    ExampleError,
    IndexFileError,
    ManifestError,
    SchemaError,
    ServerLostError,
    SplitNotFoundError,
    WireError,
    WorkerError,
)
from crossfeed.format.schema import Encoding, Feature, Schema
from crossfeed.read.dataset import Dataset, Split, open_dataset
from crossfeed.read.loader import Loader
from crossfeed.read.options import LoaderOptions, PlanOptions, ReadOptions, ShardOptions, Source
from crossfeed.read.plan import Remainder, Shuffle
from crossfeed.write.writer import write_dataset

__version__ = "0.1.0"

# The network plane pulls in pyzmq: imported on first use, so `import crossfeed` stays light.
_LAZY = {
    "connect": "crossfeed.net.client",
    "Client": "crossfeed.net.client",
    "ClientKeys": "crossfeed.net.keys",
    "BatchMeta": "crossfeed.net.wire",
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
    "Encoding",
    "ExampleError",
    "Feature",
    "IndexFileError",
    "Loader",
    "LoaderOptions",
    "ManifestError",
    "PlanOptions",
    "ReadOptions",
    "Remainder",
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
    "connect",
    "open_dataset",
    "write_dataset",
]
