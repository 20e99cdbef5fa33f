"""Packed rows through `crossfeed serve` → `crossfeed.connect`: a real server process on an
ipc:// socket streams the Loader's packed batches, every token of the epoch exactly once; and
through `crossfeed dispatch --pack-length` to `serve --dispatcher` servers (one killed
mid-epoch), every token exactly once per epoch; with --skip (ranges inside an epoch and across its
end, a server killed mid-epoch) only the kept steps, the Loader's batches at the same global steps."""

from __future__ import annotations

import collections
import json
import os
import signal

import numpy as np
import pytest
from dispatch_helpers import read_packed, spawn, start_dispatcher, start_server
from net_helpers import FAST_HB, child, read_endpoint, stop, wait_until
from test_pack import every_token, pieces, same, tokens_of
from token_data import write_tokens

import crossfeed
from crossfeed.net import connect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # slow: dispatch with servers killed


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


def _dispatched(
    tmp_path, path, *, seed: int, epochs: int, kill: bool = False, skip: str | None = None, pace_after: str = "0.01"
):
    """`crossfeed dispatch --pack-length 24` (batches of 2 rows), two `serve --dispatcher`
    servers and two trainers (`dispatch_helpers.packed_trainer`) in real processes; `kill`: one
    server is SIGKILLed mid-epoch, after its first batch reached a trainer (then the trainers
    sleep `pace_after` s a batch); `skip`: a skip file
    the dispatcher and both servers are given (`--skip`). Returns what the trainers used,
    (epoch, seq, server id, columns) each, and the killed server's process."""
    skipping = ["--skip", skip] if skip is not None else []
    extra = ["--pack-length", "24", "--seed", str(seed), "--epochs", str(epochs), *skipping]
    d, address = start_dispatcher(tmp_path, path, "tcp://127.0.0.1:0", *extra, batch=2)
    procs, victim = [d], None
    try:
        servers = [start_server(tmp_path, path, address, f"s{i}", *skipping) for i in range(2)]
        procs += servers
        outs = [tmp_path / f"t{i}.out" for i in range(2)]
        pace = tmp_path / "pace"
        pace.write_text("0.1" if kill else "0.01")
        procs += [
            spawn("packed_trainer", address, str(out), str(pace), log=tmp_path / f"t{i}.log")
            for i, out in enumerate(outs)
        ]
        if kill:
            victim = servers[0]
            mine = f":{victim.pid}"
            wait_until(
                lambda: any(x[2].endswith(mine) for out in outs for x in read_packed(out)),
                60,
                "a batch from the server to kill",
                procs,
            )
            os.kill(victim.pid, signal.SIGKILL)  # mid-epoch, holding leases
            pace.write_text(pace_after)
        for t in procs[3:]:
            assert t.wait(60) == 0, [(tmp_path / f"t{i}.log").read_text()[-3000:] for i in range(2)]
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    return [x for out in outs for x in read_packed(out)], victim


def _key(cols: dict) -> str:
    return json.dumps({k: np.asarray(cols[k]).tolist() for k in ("tokens", "segment_ids", "positions")})


def _check_epochs(used, path, lengths, *, seed: int, epochs: int, skip: str | None = None) -> list[int]:
    """Each epoch's batches are the Loader's packed batches for the seed (as a multiset: the
    trainers interleave), each under its own id, every token exactly once; returns the epochs'
    row counts. With ``skip`` (a skip file of step ranges): batch id ``b`` of epoch ``e`` is the
    epoch's ``b``-th kept global step, and holds the unskipped plan's batch at that global step
    (a global step counts the earlier epochs' steps: ``first``); the batches are the Loader's own
    with the same skip file, and every token of the kept steps arrives once, none of a skipped one."""
    from crossfeed.net.lease.book import PACKED_STRIDE
    from crossfeed.read.skips import Skip

    ranges = Skip.of(skip).steps if skip is not None else ()
    rows, first = [], 0
    for e in range(epochs):
        with crossfeed.Loader(path, batch_size=2, seed=seed, pack=crossfeed.Pack(24)) as ld:
            ld.set_epoch(e)
            whole = list(ld)
            rows.append(ld.pipeline.sampler.epoch_total(e))
        steps = [first + i for i in range(len(whole)) if not any(lo <= first + i < hi for lo, hi in ranges)]
        want = [whole[g - first] for g in steps]
        if skip is not None:
            with crossfeed.Loader(path, batch_size=2, seed=seed, pack=crossfeed.Pack(24), skip=skip) as ld:
                ld.set_epoch(e)
                assert same(list(ld), want)  # the Loader's own packed batches with the same skip list
        got = [x for x in used if x[0] == e]
        assert sorted(x[1] - e * PACKED_STRIDE for x in got) == list(range(len(want))), "a batch id lost or twice"
        assert all(_key(x[3]) == _key(want[x[1] - e * PACKED_STRIDE]) for x in got)  # id b: kept global step b
        batches = [{k: np.asarray(v) for k, v in x[3].items()} for x in got]
        kept = every_token(lengths) if skip is None else np.sort(tokens_of(want))
        assert np.sort(tokens_of(batches)).tolist() == kept.tolist()
        first += len(whole)
    assert len(used) == sum(1 for x in used if x[0] < epochs)
    return rows


# ds 0, seed 2: epoch 0 packs into 55 rows (28 batches, the last half empty), epoch 1 into 60 (30)
TWO_EPOCHS = np.random.default_rng(0).integers(5, 20, 100).tolist()


def test_dispatch_packed_two_epochs_of_different_row_counts_every_token_once(tmp_path):
    path = write_tokens(tmp_path / "t", TWO_EPOCHS)
    used, _ = _dispatched(tmp_path, path, seed=2, epochs=2)
    rows = _check_epochs(used, path, TWO_EPOCHS, seed=2, epochs=2)
    assert rows[0] != rows[1] and -(-rows[0] // 2) != -(-rows[1] // 2), rows  # the data's premise
    assert "packed batches in epoch 0" in (tmp_path / "d.log").read_text()


def test_dispatch_packed_a_server_killed_mid_epoch_every_token_once(tmp_path):
    lengths = np.random.default_rng(1).integers(5, 20, 300).tolist()
    path = write_tokens(tmp_path / "t", lengths)
    used, victim = _dispatched(tmp_path, path, seed=3, epochs=1, kill=True, pace_after="0.1")  # outlasts the timeout
    _check_epochs(used, path, lengths, seed=3, epochs=1)
    from_victim = sum(x[2].endswith(f":{victim.pid}") for x in used)
    assert 0 < from_victim < len(used) // 2, from_victim
    assert "declared dead" in (tmp_path / "d.log").read_text()  # its leases went to the other server


def test_dispatch_packed_with_skipped_steps_leases_only_the_kept_global_steps(tmp_path):
    """Global steps 3-5 (inside epoch 0, of 28 steps) and 26-30 (its last two and epoch 1's first
    three) are never leased: each epoch counts its kept steps, every kept one is delivered once
    under its own id, as the Loader with the same skip file gives it."""
    path = write_tokens(tmp_path / "t", TWO_EPOCHS)
    skips = tmp_path / "skips.txt"
    skips.write_text("# a loss spike, and one across the epochs' boundary\nsteps 3 6\nsteps 26 31\n")
    used, _ = _dispatched(tmp_path, path, seed=2, epochs=2, skip=str(skips))
    rows = _check_epochs(used, path, TWO_EPOCHS, seed=2, epochs=2, skip=str(skips))
    assert [-(-r // 2) for r in rows] == [28, 30]  # the data's premise: the ranges lie where said
    assert collections.Counter(x[0] for x in used) == {0: 23, 1: 27}
    said = "dispatching 23 packed batches in epoch 0 (a count of its own each epoch, skipped steps left out)"
    assert said in (tmp_path / "d.log").read_text()


def test_dispatch_packed_with_skipped_steps_a_server_killed_mid_epoch_still_exact(tmp_path):
    lengths = np.random.default_rng(1).integers(5, 20, 300).tolist()
    path = write_tokens(tmp_path / "t", lengths)
    skips = tmp_path / "skips.txt"
    skips.write_text("steps 10 20\nsteps 40 42\n")
    # the trainers keep their pace: the epoch outlasts the victim's heartbeat timeout, so the
    # dispatcher declares it dead mid-epoch (its work may have been taken over before)
    used, victim = _dispatched(tmp_path, path, seed=3, epochs=1, kill=True, skip=str(skips), pace_after="0.1")
    _check_epochs(used, path, lengths, seed=3, epochs=1, skip=str(skips))
    assert len(used) == 81 - 12  # the epoch's 81 steps, 12 of them skipped
    assert 0 < sum(x[2].endswith(f":{victim.pid}") for x in used) < len(used) // 2
    assert "declared dead" in (tmp_path / "d.log").read_text()


def test_dispatch_packed_refuses_a_server_with_another_skip_list_naming_it(tmp_path):
    path = write_tokens(tmp_path / "t", [5, 9, 30, 2, 17, 8, 40, 3, 11, 25])
    mine, other = tmp_path / "mine.txt", tmp_path / "other.txt"
    mine.write_text("steps 1 3\n")
    other.write_text("steps 1 4\n")
    extra = ["--pack-length", "24", "--epochs", "1", "--skip", str(mine)]
    d, address = start_dispatcher(tmp_path, path, "tcp://127.0.0.1:0", *extra, batch=2)
    procs = [d]
    try:
        procs.append(start_server(tmp_path, path, address, "wrong", "--skip", str(other)))
        wait_until(lambda: "serve the same dataset" in (tmp_path / "wrong.log").read_text(), 60, "a refusal", procs)
    finally:
        stop(*procs)
    log = (tmp_path / "wrong.log").read_text()
    assert "skip steps was [[1, 3]], is [[1, 4]]" in log and "with the same --skip" in log, log[-3000:]


def test_pack_walker_builds_leased_batches_in_any_order(tmp_path):
    """A server's walk over an epoch's rows (`PackWalker`): batches forward, skipped, behind the
    walk (a re-lease: walked again from the epoch's start) and past the end."""
    from crossfeed.errors import ConfigError
    from crossfeed.read.stages.pack import PackWalker

    path = write_tokens(tmp_path / "t", TWO_EPOCHS)
    with crossfeed.Loader(path, batch_size=2, seed=2, pack=crossfeed.Pack(24)) as ld:
        walker = PackWalker(ld.pipeline.sampler)
        for e in (0, 1):
            ld.set_epoch(e)
            want = list(ld)
            n = len(want)
            for b in [0, 1, 4, 2, 3, n - 1, 0, n - 2, 5]:
                got = ld.pipeline.builder(walker.batch(e, b))
                assert all(np.array_equal(got[k], want[b][k]) for k in want[b]), (e, b)
            with pytest.raises(ConfigError, match="past the end"):
                walker.batch(e, n)
        assert walker.restarts == 6


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        (["--batch-by-tokens", "64"], "crossfeed serve"),
        (["--pack-length", "16", "--world-size", "2"], "equal per-rank counts"),
    ],
)
def test_dispatch_refuses_token_budgets_and_packed_lockstep_and_says_why(tmp_path, flag, says):
    from typer.testing import CliRunner

    from crossfeed.cli.main import app

    path = write_tokens(tmp_path / "t", [5, 9, 30])
    args = ["dispatch", path, f"ipc://{tmp_path}/d.sock", "--journal", str(tmp_path / "j"), "--batch-size", "1"]
    result = CliRunner().invoke(app, args + flag)
    assert result.exit_code != 0
    assert says in " ".join(result.output.split())
