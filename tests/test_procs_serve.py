"""`crossfeed serve --procs N`: the Loader's batches, built by worker processes, over the wire."""

from __future__ import annotations

import pytest
from net_helpers import serve_child, served_batches, write_image_dataset

from crossfeed.read.loader import Loader

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]  # slow: serve with worker processes


def test_serve_procs_streams_the_loaders_batches(tmp_path):
    dataset = str(tmp_path / "ds")
    write_image_dataset(dataset, 20)
    proc, ep = serve_child(
        tmp_path, dataset, "--epochs", "2", "--seed", "3", "--transform", "net_helpers:add_hundred", "--procs", "2"
    )
    got = served_batches(proc, ep, tmp_path / "serve.log")
    assert "worker processes started" in (tmp_path / "serve.log").read_text()
    for epoch in (0, 1):
        with Loader(dataset, batch_size=6, seed=3, epoch=epoch, return_index=True, rank=0, world_size=1) as loader:
            want = {tuple(b["__index__"].tolist()): b["image"][:, 0, 0, 0].tolist() for b in loader}
        # the plan's batches, each once, with the right samples in them
        assert {tuple(ids): pixels for e, ids, _, pixels in got if e == epoch} == want
        assert len([1 for e, *_ in got if e == epoch]) == len(want)
    for _, _, labels, pixels in got:
        assert labels == [p + 100 for p in pixels]  # the transform ran
