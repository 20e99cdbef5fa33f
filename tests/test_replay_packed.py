"""Packed replay in O(bins + batch) (issue 36, item 3): `Loader.batch_at` of a packed plan walks
to the step's rows from the packer's nearest cursor — one a saved state carries (``state=``,
``crossfeed replay --state``) or one this process met — never from the epoch's start when one is
near, and does not count the epoch's steps; what it names is what iteration built."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from test_pack import lognormal
from test_pack_resume import Reads, small_chunks, state_after  # noqa: F401 (a fixture)
from token_data import write_tokens
from typer.testing import CliRunner

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.read.options import Pack
from crossfeed.read.stages import pack as packmod

SHARDS, PER = 40, 60


@pytest.fixture
def far(tmp_path, small_chunks):  # noqa: F811
    """40 shards read in order, the whole run's batches, and the state saved 90% into the epoch."""
    lengths = lognormal(SHARDS * PER, 40, 1.0, seed=3)
    path = write_tokens(tmp_path / "t", lengths, num_shards=SHARDS)
    opts = dict(batch_size=2, seed=0, shuffle="none", pack=Pack(64), rank=1, world_size=2)
    with crossfeed.Loader(path, **opts) as ld:
        whole = list(ld)
    steps = len(whole) * 9 // 10
    state, _ = state_after(path, steps, **opts)
    return path, opts, whole, steps, state


def _before_cursor(path, state) -> list[int]:
    """The shards wholly before the earliest document a walk from the state's cursor may read."""
    cursor = state["pack"]
    first = min([cursor["documents"], *(p[0] for row in cursor["open"] for p in row)])
    with crossfeed.open_dataset(path) as ds:
        starts = np.asarray(ds["train"].starts)
    return [k for k in range(SHARDS) if starts[k + 1] <= first]


def test_a_step_after_a_states_cursor_reads_no_lengths_before_it(far, monkeypatch):
    """A fresh process replays the steps just after a state saved 90% into the epoch from the
    state's cursor: no lengths file of a shard before it is loaded, the epoch's steps are not
    counted, and the replayed plan builds the batches iteration built."""
    path, opts, whole, steps, state = far
    before = _before_cursor(path, state)
    assert len(before) >= 0.7 * SHARDS
    reads = Reads(monkeypatch)
    with crossfeed.Loader(path, **opts) as ld:
        reads.shards.clear()  # what opening the Loader read is not the replay's
        walks = []
        real = packmod.walk

        def recorded(order, lengths, pack, cursor=None):
            walks.append(cursor.rows if cursor is not None else 0)
            return real(order, lengths, pack, cursor)

        monkeypatch.setattr(packmod, "walk", recorded)
        for b in (steps, steps + 1):
            got = ld.batch_at(b, epoch=0, state=state)
            assert got.packed and got.walked_from is not None and got.walked_from >= state["pack"]["rows"]
            assert b > steps or got.walked_from <= state["position"]  # the state's cursor, then one past it
            built = ld.pipeline.build_batch(got.planned)
            assert all(np.array_equal(built[k], whole[b][k]) for k in whole[b])
        assert ld.pipeline.sampler.marks(0).total is None  # the epoch's end was never walked to
        assert walks and min(walks) >= state["pack"]["rows"]
        assert ld.position == 0  # the Loader's own cursor is left as it was
    assert sum(n for (_, k), n in reads.shards.items() if k in before) == 0, "read a lengths file before the cursor"


def test_without_a_cursor_near_the_walk_starts_where_it_can_and_says_so(far, caplog):
    path, opts, whole, steps, state = far
    with crossfeed.Loader(path, **opts) as ld:
        with caplog.at_level(logging.INFO, logger="crossfeed.read.replay"):
            got = ld.batch_at(steps, epoch=0)
        assert got.walked_from == 0 and "no packer cursor near step" in caplog.text
        built = ld.pipeline.build_batch(got.planned)
        assert all(np.array_equal(built[k], whole[steps][k]) for k in whole[steps])
        # the walk left cursors behind: the next step starts near it
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="crossfeed.read.replay"):
            again = ld.batch_at(steps + 1, epoch=0)
        assert again.walked_from > 0 and "no packer cursor" not in caplog.text
        # a step before the state's cursor still replays (walked from the epoch's start)
        early = ld.batch_at(1, epoch=0, state=state)
        assert all(np.array_equal(ld.pipeline.build_batch(early.planned)[k], whole[1][k]) for k in whole[1])


def test_every_step_replays_from_a_state_and_steps_past_the_end_are_refused(tmp_path, small_chunks):  # noqa: F811
    """Small chunks (cursors all along the epoch), 2 ranks, best-fit and rows, drop_last or not:
    every step of every rank replayed from a mid-epoch state (and as a global step) is the batch
    iteration built; the step after the last is refused naming the epoch's step count."""
    path = write_tokens(tmp_path / "t", lognormal(300, 20, 1.0, seed=5).tolist(), num_shards=4)
    for split in ("documents", "rows"):
        for drop_last in (False, True):
            opts = dict(batch_size=3, seed=4, pack=Pack(32, split=split, bins=4), world_size=2, drop_last=drop_last)
            for rank in range(2):
                with crossfeed.Loader(path, rank=rank, **opts) as ld:
                    whole = [list(ld) for _ in range(2)]
                n = len(whole[0])
                state, _ = state_after(path, n // 2, rank=rank, **opts)
                with crossfeed.Loader(path, rank=rank, **opts) as ld:
                    for b in [*range(n // 2, n), *range(n // 2)]:
                        got = ld.batch_at(b, epoch=0, state=state)
                        built = ld.pipeline.build_batch(got.planned)
                        assert all(np.array_equal(built[k], whole[0][b][k]) for k in built), (split, drop_last, b)
                    with pytest.raises(ConfigError, match=rf"step {n} is beyond epoch 0: it has {n} steps per rank"):
                        ld.batch_at(n, epoch=0, state=state)
                with crossfeed.Loader(path, rank=rank, **opts) as ld:
                    for g in (n + 1, 2 * n - 1):  # global steps of epoch 1
                        got = ld.batch_at(g)
                        assert (got.epoch, got.step) == (1, g - n)
                        built = ld.pipeline.build_batch(got.planned)
                        assert all(np.array_equal(built[k], whole[1][g - n][k]) for k in built)


def test_a_state_of_another_stream_is_refused(far):
    path, opts, _, steps, state = far
    with crossfeed.Loader(path, **{**opts, "seed": 1}) as ld:
        with pytest.raises(ConfigError, match="this state belongs to another stream: seed was 0, is 1"):
            ld.batch_at(steps, state=state)


def test_replay_command_walks_on_from_the_states_cursor(far, tmp_path, monkeypatch):
    from crossfeed.cli.main import app

    path, opts, whole, steps, state = far
    (tmp_path / "state.json").write_text(json.dumps(state))
    with crossfeed.Loader(path, **opts) as ld:
        want = ld.batch_at(steps + 1, epoch=0, state=state)
    before = _before_cursor(path, state)
    reads = Reads(monkeypatch)
    args = ["replay", str(path), "--step", str(steps + 1), "--state", str(tmp_path / "state.json"), "--json"]
    args += ["-b", "2", "--shuffle", "none", "--pack-length", "64", "--rank", "1"]
    res = CliRunner().invoke(app, [*args, "--world-size", "2"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(x["row"], x["key"], x["start"], x["count"]) for x in lines] == [
        (s.row, s.key, s.start, s.count) for s in want
    ]
    assert sum(n for (_, k), n in reads.shards.items() if k in before) == 0, "read a lengths file before the cursor"
