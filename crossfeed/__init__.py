"""crossfeed: convert a dataset once, read it from TensorFlow and PyTorch, serve it over the network.

The public surface is the names below; everything else lives in submodules. Importing crossfeed
never imports tensorflow, torch or apache_beam.
"""

from crossfeed.dataset import Dataset, Split, open_dataset
from crossfeed.errors import (
    ConfigError,
    CorruptRecordError,
    CrossfeedError,
    DatasetNotFoundError,
    ExampleError,
    IndexFileError,
    ManifestError,
    SchemaError,
    WireError,
)
from crossfeed.schema import Encoding, Feature, Schema
from crossfeed.writer import write_dataset

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CorruptRecordError",
    "CrossfeedError",
    "Dataset",
    "DatasetNotFoundError",
    "Encoding",
    "ExampleError",
    "Feature",
    "IndexFileError",
    "ManifestError",
    "Schema",
    "SchemaError",
    "Split",
    "WireError",
    "open_dataset",
    "write_dataset",
]
