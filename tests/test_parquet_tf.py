"""Parquet files read in place through the tf.data adapter (the plan engine: the Loader), with
pyarrow's values; the native TFRecord engine is refused with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import
from parquet_data import ROWS, oracle, write_pyarrow_files

from crossfeed.errors import ConfigError
from crossfeed.write.adopt.index import index_dataset

cftf = lazy_import("crossfeed.adapters.tf")
pytestmark = pytest.mark.slow  # TensorFlow imported


def test_tf_dataset_reads_parquet_through_the_loader(tmp_path):
    paths = write_pyarrow_files(tmp_path)
    index_dataset(tmp_path)
    expected = oracle(paths)
    ds = cftf.dataset(tmp_path, batch_size=16, features=["id", "vec", "mat"], seed=2, return_index=True)
    seen = []
    for b in ds.as_numpy_iterator():
        assert b["mat"].dtype == np.int16 and b["mat"].shape[1:] == (2, 2)
        for j, i in enumerate(b["__index__"].tolist()):
            np.testing.assert_array_equal(b["vec"][j], np.asarray(expected["vec"][i], np.float32))
            np.testing.assert_array_equal(b["mat"][j], np.asarray(expected["mat"][i], np.int16))
        np.testing.assert_array_equal(b["id"], b["__index__"])
        seen += b["id"].tolist()
    assert sorted(seen) == list(range(sum(ROWS)))
    with pytest.raises(ConfigError, match="engine='native' cannot honour parquet shards"):
        cftf.dataset(tmp_path, batch_size=16, engine="native")
