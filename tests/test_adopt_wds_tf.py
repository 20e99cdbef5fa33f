"""tf.data over WebDataset tars read in place: the TF adapter takes the plan engine for tar
shards (TFRecordDataset cannot read them) and yields the Loader's batches."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
from conftest import lazy_import

import crossfeed
from crossfeed.read.loader import Loader
from crossfeed.write.adopt.index import index_dataset

tf = lazy_import("tensorflow")
cftf = lazy_import("crossfeed.adapters.tf")
pytestmark = pytest.mark.slow  # TensorFlow imported


def test_tf_dataset_reads_tar_shards_with_the_plan_engine(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    with tarfile.open(root / "data.tar", "w") as t:
        for i in range(10):
            for ext, payload in (("cls", str(i).encode()), ("npy", _npy(np.full((2, 3), i, np.int32)))):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(payload)
                t.addfile(info, io.BytesIO(payload))
    index_dataset(root)
    kw = dict(batch_size=4, shuffle="global", seed=3)
    expected = [b["cls"].tolist() for b in Loader(root, **kw)]
    got = []
    for b in cftf.dataset(str(root), **kw):
        got.append(b["cls"].numpy().tolist())
        np.testing.assert_array_equal(b["npy"].numpy(), np.stack([np.full((2, 3), c, np.int32) for c in got[-1]]))
    assert got == expected
    with pytest.raises(crossfeed.ConfigError, match="tar shards"):
        cftf.dataset(str(root), engine="native", **kw)


def _npy(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()
