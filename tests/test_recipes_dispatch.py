"""The recipes' bookkeeping at a dispatcher, without sockets: an epoch whose steps are all skipped
ends at once (journaled, replayed), a lockstep quota scales with each epoch's kept steps, the plan a
dispatcher ships carries no skip list (each server reads its own, checked by the identity the
dispatcher sends whole), and the commands' --skip/--filter/--max-filtered flags reach the options."""

from __future__ import annotations

import json

import pytest
from test_net_leases import S1, T1, T2, run_epoch, tok
from typer.testing import CliRunner

from crossfeed.cli.main import app
from crossfeed.errors import ConfigError
from crossfeed.net.lease import messages as W
from crossfeed.net.lease.book import LeaseBook
from crossfeed.net.lease.dispatcher import DispatcherOptions, LeaseDispatcher
from crossfeed.net.lease.source import _differences
from crossfeed.read.identity import StreamIdentity
from crossfeed.read.options import LoaderOptions
from crossfeed.read.skips import Skip

KEPT = {0: 6, 1: 0, 2: 4}  # batches of each epoch once skipped steps are left out (of a stride of 8)


def test_an_epoch_of_skipped_steps_only_ends_at_once_and_the_journal_replays_it(tmp_path):
    options = DispatcherOptions("ipc://x", tmp_path / "j", epochs=3, lease_size=2, window=4)

    def book():
        from crossfeed.net.lease.dispatcher import recover

        return recover({"batch_size": 2}, 8, options, 0.0, KEPT.__getitem__)

    b, journal = book()
    b.server_seen(S1, 0.0, "a")
    b.trainer_seen(T1, 0.0)
    assert run_epoch(b, 1) == list(range(6))  # epoch 0's six, then epoch 1 (none) passes with it
    assert b.epoch == 2 and b.n == 4 and not b.finished
    journal.append(b.take_records())
    journal.close()
    again, _ = book()  # a restarted dispatcher continues in epoch 2
    assert again.epoch == 2 and again.n == 4
    again.server_seen(S1, 0.0, "a")
    again.trainer_seen(T1, 0.0)
    assert run_epoch(again, 1) == [16, 17, 18, 19] and again.finished


def test_a_lockstep_quota_scales_with_each_epochs_kept_steps():
    """Two ranks, 4 steps a rank (a stride of 8): epoch 0 keeps 3 steps (6 batches), epoch 2 two."""
    b = LeaseBook(8, epochs=3, lease_size=8, window=8, quota=4, counts=KEPT.__getitem__)
    assert b.quota == 3
    b.server_seen(S1, 0.0, "a")
    b.trainer_seen(T1, 0.0)
    b.trainer_seen(T2, 0.0)
    claimed = {}
    for trainer in (T1, T2):  # each claims all it receives; past its quota the claim is refused
        (lease,) = b.grant_leases(0.0)
        claimed[trainer] = [x for x in lease.batches if b.claim(trainer, x, tok(lease, x), now=0.0)]
    assert [len(v) for v in claimed.values()] == [3, 3]
    for trainer, batches in claimed.items():
        assert all(b.done(trainer, x, now=0.0) for x in batches)
    assert b.epoch == 2 and b.quota == 2  # epoch 1 kept nothing: passed


def test_the_plan_carries_no_skip_list_and_a_server_keeps_its_own():
    skip = Skip(steps=[(2, 4)], samples=[(0, i) for i in range(20_000)])  # more ids than a message holds
    planner = LoaderOptions.of(batch_size=4, skip=skip)
    shipped = planner.plan_fields()
    assert "skip" not in shipped and len(json.dumps(shipped)) < 2000
    mine = LoaderOptions.of(batch_size=1, skip=Skip(steps=[(5, 6)]))
    assert LoaderOptions.from_plan(shipped, mine).plan.skip == mine.plan.skip
    with pytest.raises(ConfigError, match=r"a plan does not carry \['skip'\]"):
        LoaderOptions.from_plan({**shipped, "skip": {"steps": [[2, 4]]}}, mine)


def test_welcome_carries_the_identitys_settings_when_they_fit_and_a_server_names_what_differs(tmp_path):
    theirs = StreamIdentity({"seed": 1, "skip steps": [[2, 4]], "skip samples": "2 sha256:ab"})
    ours = StreamIdentity({"seed": 1, "skip steps": [[2, 5]], "skip samples": "2 sha256:ab"})
    options = DispatcherOptions(f"ipc://{tmp_path}/d")
    with LeaseDispatcher({"batch_size": 4}, 10, options, identity=theirs.to_json()) as d:
        welcome = json.loads(d._welcome)
    assert d.plan["identity"] == theirs.fingerprint and "stream" not in d.plan  # the journal: the fingerprint
    assert welcome["stream"] == dict(theirs.settings)
    said = _differences(welcome["identity"], welcome["stream"], ours)
    assert said == "was: the dispatcher's, is: this server's: skip steps was [[2, 4]], is [[2, 5]]"
    assert "another dataset" in _differences(welcome["identity"], {"seed": 2}, ours)  # forged: not trusted
    big = StreamIdentity({"skip steps": [[i, i + 1] for i in range(0, 2 * W.MAX_TEXT // 8, 2)]})
    with LeaseDispatcher({"batch_size": 4}, 10, options, identity=big.to_json()) as d:
        assert "stream" not in json.loads(d._welcome)  # too long: the fingerprint alone


def test_the_recipe_flags_reach_the_options(tmp_path, monkeypatch):
    got = {}

    class Epochs:
        def __init__(self, dataset, options, *, transform=None, filter=None):
            got.update(options=options, filter=filter)
            raise SystemExit(0)

    monkeypatch.setattr("crossfeed.net.run.LoaderEpochs", Epochs)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "keepers.py").write_text("def even(sample):\n    return int(sample['label']) % 2 == 0\n")
    skips = tmp_path / "skips.txt"
    skips.write_text("steps 2 4\n7\n")
    argv = ["serve", str(tmp_path), f"ipc://{tmp_path}/s", "--skip", str(skips)]
    r = CliRunner().invoke(app, [*argv, "--filter", "keepers:even", "--max-filtered", "0.5"])
    assert r.exit_code == 0, r.output
    assert got["options"].plan.skip == Skip(steps=[(2, 4)], samples=[7]) and got["options"].read.max_filtered == 0.5
    assert got["filter"].__name__ == "even"
    r = CliRunner().invoke(app, [*argv[:3], "--skip", str(tmp_path / "missing.txt")])
    assert r.exit_code != 0 and "missing.txt" in r.output
