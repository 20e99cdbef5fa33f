"""Packed rows through `crossfeed serve` → `crossfeed.connect`: a real server process on an
ipc:// socket streams the Loader's packed batches, every token of the epoch exactly once."""

from __future__ import annotations

import numpy as np
import pytest
from net_helpers import FAST_HB, child, read_endpoint, stop
from test_pack import every_token, pieces, tokens_of
from token_data import write_tokens

import crossfeed
from crossfeed.net import connect

pytestmark = pytest.mark.timeout(120)


def test_serve_streams_packed_rows_every_token_once(tmp_path):
    lengths = [5, 9, 30, 2, 17, 8, 40, 3, 11, 25, 1, 14, 6, 19, 33, 4, 70]
    path = write_tokens(tmp_path / "t", lengths)
    ep, log = tmp_path / "ep", tmp_path / "serve.log"
    proc = child(
        "cli",
        "serve",
        path,
        f"ipc://{tmp_path}/s.sock",
        "--batch-size",
        "2",
        "--pack-length",
        "16",
        "--seed",
        "4",
        "--epochs",
        "1",
        "--heartbeat-interval",
        "0.1",
        "--heartbeat-timeout",
        "2",
        "--endpoint-file",
        str(ep),
        log=log,
    )
    try:
        with connect(read_endpoint(ep, procs=[proc]), **FAST_HB) as client:
            got = [{k: np.asarray(v) for k, v in b.items()} for b in client]
        assert proc.wait(30) == 0, log.read_text()
    finally:
        stop(proc)
    with crossfeed.Loader(path, batch_size=2, seed=4, pack=crossfeed.Pack(16)) as ld:
        want = list(ld)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert set(a) == {"tokens", "segment_ids", "positions"} and a["tokens"].shape == (2, 16)
        assert all(np.array_equal(a[k], b[k]) for k in b)
        pieces(a)
    assert np.sort(tokens_of(got)).tolist() == every_token(lengths).tolist()


@pytest.mark.parametrize("flag", [["--pack-length", "16"], ["--batch-by-tokens", "64"]])
def test_dispatch_refuses_packing_and_says_why(tmp_path, flag):
    from typer.testing import CliRunner

    from crossfeed.cli.main import app

    path = write_tokens(tmp_path / "t", [5, 9, 30])
    args = ["dispatch", path, f"ipc://{tmp_path}/d.sock", "--journal", str(tmp_path / "j"), "--batch-size", "1"]
    result = CliRunner().invoke(app, args + flag)
    assert result.exit_code != 0
    assert "walking the epoch's lengths" in " ".join(result.output.split()) and "crossfeed serve" in result.output
