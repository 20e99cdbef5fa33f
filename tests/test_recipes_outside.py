"""Issue 36's recipes from outside, under change and hostile input: mixture schedules, per-sample
weights, appended dataset versions and step replay given what a demanding user or an untrusted
directory hands them — numbers past what a plan counts, weights files and kept manifests that are
links out of the dataset, FIFOs or directories — refused by name (no raw exception, no hang, no
file read or written outside the dataset), and their parsers fuzzed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import requires
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import crossfeed
from crossfeed.cli.main import app
from crossfeed.errors import ConfigError, IndexFileError, ManifestError, RootNotAllowedError
from crossfeed.format import weights as fw
from crossfeed.read.schedule import Schedule
from crossfeed.read.sources.mixture_file import load_mixture_spec


def _weighted(root):
    crossfeed.write_dataset(root, [{"x": i, "w": i % 3} for i in range(10)]).close()
    crossfeed.write_weights(root, feature="w")
    return root


def _appended(root):
    crossfeed.write_dataset(root, [{"x": i} for i in range(8)]).close()
    crossfeed.write_dataset(root, [{"x": 100 + i} for i in range(4)], append=True).close()
    return root


def _read(path, **kw):
    with crossfeed.Loader(path, batch_size=2, seed=0, **kw) as loader:
        return sorted(int(x) for b in loader for x in b["x"])


# ---- numbers past what a plan counts ---------------------------------------------------------------


def test_a_schedule_boundary_past_what_a_plan_counts_is_refused_by_name(tmp_path):
    """A boundary of 10^29 samples (a typo, or a hostile spec file) is refused where the schedule
    is made, naming the point — not an OverflowError deep in the sampler, not a traceback."""
    with pytest.raises(ConfigError, match="sample must be an integer"):
        Schedule.constant([(0, 3), (10**29, 1)])
    with pytest.raises(ConfigError, match="sample must be an integer"):
        Schedule.constant([(0, 3), (2**61, 1)], per_step=8)  # in steps: 2^64 samples
    with pytest.raises(ConfigError, match="sample must be an integer"):
        Schedule.from_json({"linear": [[0, 1], [2**63, 2]], "every": 2**62})
    Schedule.constant([(0, 3), (2**60, 1)])  # far, but counted
    for name in ("web", "books"):
        crossfeed.write_dataset(tmp_path / name, [{"x": i} for i in range(8)]).close()
    spec = tmp_path / "mix.json"
    spec.write_text(
        json.dumps(
            {
                "sources": [
                    {"path": str(tmp_path / "web"), "weight": {"constant": [[0, 3], [10**29, 1]]}},
                    {"path": str(tmp_path / "books")},
                ],
                "samples_per_epoch": 16,
            }
        )
    )
    res = CliRunner().invoke(app, ["replay", str(spec), "--step", "1", "--batch-size", "4"])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "sample must be an integer" in res.stderr


def test_a_weighted_or_scheduled_plan_refuses_an_epoch_past_what_it_counts(tmp_path):
    """A weighted or scheduled plan counts samples since the run began on 64-bit integers: a state
    of epoch 10^30 (crafted or damaged) or a replayed step that far is refused by name, as a plain
    plan's position outside its epoch is — never a raw OverflowError."""
    root = _weighted(tmp_path / "d")
    crossfeed.write_dataset(tmp_path / "b", [{"x": 100 + i, "w": 1} for i in range(6)]).close()
    scheduled = [
        crossfeed.Source(root, weight=Schedule.constant([(0, 1), (9, 2)])),
        crossfeed.Source(tmp_path / "b"),
    ]
    for src, kw in ((root, {"weights": "w"}), (scheduled, {"samples_per_epoch": 20})):
        with crossfeed.Loader(src, batch_size=5, seed=2, **kw) as loader:
            next(iter(loader))
            state = loader.state_dict()
        state["epoch"] = 10**30
        with crossfeed.Loader(src, batch_size=5, seed=2, **kw) as loader:
            with pytest.raises(ConfigError, match="epoch 1000000000000000000000000000000"):
                loader.load_state_dict(state)
                list(loader)
    res = CliRunner().invoke(app, ["replay", str(root), "--step", str(10**20), "--batch-size", "4", "--weights", "w"])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "epoch" in res.stderr
    # a later epoch that fits is planned as usual
    with crossfeed.Loader(root, batch_size=5, seed=2, weights="w") as loader:
        assert len(loader.batch_at(10**9)) == 5


# ---- a dataset's own files stay inside it ----------------------------------------------------------


@pytest.mark.parametrize("which", ["json", "cw", "dir"])
def test_a_weights_set_that_links_out_of_the_dataset_is_refused_unless_allowed(tmp_path, which):
    """A weights set is a dataset's own file, read as its shards are: one whose description, prefix
    sums or whole ``weights/`` folder is a symbolic link out of the dataset (the same bytes, so only
    the link is wrong) is refused naming the link; allowing the target's directory reads it."""
    root = _weighted(tmp_path / "d")
    want = _read(root, weights="w")
    outside = tmp_path / "elsewhere"
    name = {"json": "weights/w.json", "cw": "weights/w.train.cw", "dir": "weights"}[which]
    target = outside if which == "dir" else outside / os.path.basename(name)
    if which != "dir":
        outside.mkdir()
    shutil.move(root / name, target)
    (root / name).symlink_to(target)
    with pytest.raises(RootNotAllowedError, match="symbolic link.*outside the dataset"):
        _read(root, weights="w")
    assert _read(root, weights="w", allowed_roots=[str(outside)]) == want


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_weights_file_that_is_not_a_regular_file_is_refused_without_hanging(tmp_path, kind):
    """A directory or a FIFO where a weights set's description or prefix sums should be is refused
    by name (`IndexFileError`), in a fresh process that would otherwise block on the FIFO for ever."""
    root = _weighted(tmp_path / "d")
    for name in ("w.json", "w.train.cw"):
        path = root / "weights" / name
        saved = path.read_bytes()
        path.unlink()
        os.mkdir(path) if kind == "directory" else os.mkfifo(path)
        code = textwrap.dedent(f"""
            import crossfeed
            try:
                with crossfeed.Loader({str(root)!r}, batch_size=2, weights="w") as loader:
                    list(loader)
            except crossfeed.CrossfeedError as e:
                print(type(e).__name__, e)
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("IndexFileError") and "not a regular file" in out.stdout, out.stdout
        os.rmdir(path) if kind == "directory" else path.unlink()
        path.write_bytes(saved)


def test_a_kept_version_manifest_that_links_out_or_is_not_a_file_is_refused(tmp_path):
    """``crossfeed.v1.json`` (version 1 of an appended dataset, read for ``path@v1``) is the
    dataset's own file: a link out of the dataset to the same bytes is refused unless its directory
    is allowed; a directory or a FIFO there is a `ManifestError` naming it, never a raw
    IsADirectoryError or a reader blocked for ever. The current version reads on regardless."""
    root = _appended(tmp_path / "v")
    kept = root / "crossfeed.v1.json"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(kept, outside / kept.name)
    kept.symlink_to(outside / kept.name)
    with pytest.raises(RootNotAllowedError, match="symbolic link.*outside the dataset"):
        _read(f"{root}@v1")
    assert _read(f"{root}@v1", allowed_roots=[str(outside)]) == list(range(8))
    kept.unlink()
    kept.mkdir()
    with pytest.raises(ManifestError, match="crossfeed.v1.json: not a regular file"):
        _read(f"{root}@v1")
    kept.rmdir()
    os.mkfifo(kept)
    code = textwrap.dedent(f"""
        import crossfeed
        try:
            crossfeed.open_dataset({str(root)!r} + "@v1")
        except crossfeed.CrossfeedError as e:
            print(type(e).__name__, e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ManifestError") and "not a regular file" in out.stdout, out.stdout
    assert _read(root) == [*range(8), *range(100, 104)]


def test_writing_weights_never_writes_through_a_link_out_of_the_dataset(tmp_path):
    """`crossfeed weights` on a dataset whose ``weights/`` is a link out of it (a planted
    directory) writes nothing there: refused naming the link and how to allow its target."""
    root = tmp_path / "d"
    crossfeed.write_dataset(root, [{"x": i, "w": i % 3} for i in range(10)]).close()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "weights").symlink_to(outside)
    res = CliRunner().invoke(app, ["weights", str(root), "--feature", "w"])
    assert res.exit_code == 2, res.output
    assert "symbolic link" in res.stderr and "outside the dataset" in res.stderr and "Traceback" not in res.output
    assert list(outside.iterdir()) == []
    crossfeed.write_weights(root, feature="w", allowed_roots=[str(outside)])  # allowed: written there
    assert _read(root, weights="w", samples_per_epoch=9, allowed_roots=[str(outside)]) == [1, 2, 2, 4, 5, 5, 7, 8, 8]


def test_a_ramp_to_a_huge_finite_weight_is_planned_or_refused_by_name():
    """A linear schedule between finite weights never evaluates to infinity (the line is
    interpolated without overflowing), so a ramp to 6.7e296 is planned as shares of 1000, and
    a constant huge weight is refused as too fine-grained — never a raw OverflowError."""
    from crossfeed.read.stages.sampler import mixture_phases

    ramp = Schedule.from_json({"linear": [[0, 1], [269699656073, 6.665537364950874e296]], "every": 65892904})
    phases = mixture_phases([ramp, Schedule.from_json({"linear": [[0, 1], [1, 0.0]], "every": 1})])
    assert phases[0] == (0, (1, 1)) and all(sum(w) <= 1000 for _, w in phases)
    with pytest.raises(ConfigError, match="too fine-grained"):
        mixture_phases([Schedule.constant([(0, 1e300)]), 1])


def test_integer_weights_times_the_resolution_never_wrap_around(tmp_path):
    """An integer weight that, times ``--resolution``, passes the slot space (2^62) is refused by
    name — it wrapped around int64 silently before (2^61 + 1 at resolution 8 became weight 8), and
    a uint64 weight past 2^63 was called negative."""
    with pytest.raises(ConfigError, match="past"):
        fw.quantise(np.array([2**61 + 1, 1]), 8)
    with pytest.raises(ConfigError, match="past"):
        fw.quantise(np.array([2**63 + 5, 1], dtype=np.uint64))
    assert fw.quantise(np.array([2**59, 1]), 8).tolist() == [2**62, 8]
    root = tmp_path / "q"
    crossfeed.write_dataset(root, [{"x": i, "w": 2**61 + 1 if i == 0 else 1} for i in range(4)]).close()
    res = CliRunner().invoke(app, ["weights", str(root), "--feature", "w", "--resolution", "8"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "feature 'w'" in res.stderr and "resolution" in res.stderr
    assert not (root / "weights" / "w.json").exists()


def test_replay_of_a_weighted_run_takes_its_epoch_size_from_the_state(tmp_path):
    """A weighted run of ``samples_per_epoch`` draws (43 here: no command-line flag sets it) is
    replayed from its checkpoint: ``--state`` carries the epoch size as it carries the seed and
    batch size, and the step named is the one the run delivered."""
    root = tmp_path / "d"
    crossfeed.write_dataset(root, [{"x": i, "w": i % 4} for i in range(30)], num_shards=2).close()
    crossfeed.write_weights(root, feature="w")
    with crossfeed.Loader(root, batch_size=4, seed=3, weights="w", samples_per_epoch=43, return_index=True) as loader:
        it = iter(loader)
        delivered = [next(it)["__index__"].tolist() for _ in range(7)]
        state = loader.state_dict()
    (tmp_path / "state.json").write_text(json.dumps(state))
    args = ["replay", str(root), "--weights", "w", "--state", str(tmp_path / "state.json"), "--json"]
    res = CliRunner().invoke(app, [*args, "--step", "5"])
    assert res.exit_code == 0, res.output
    assert [json.loads(line)["index"] for line in res.stdout.splitlines()] == delivered[5]
    res = CliRunner().invoke(app, ["replay", str(root), "--state", str(tmp_path / "state.json"), "--step", "5"])
    assert res.exit_code == 2 and "weights was 'w sha256:" in res.stderr, res.output  # the set must still be named


def test_a_mixture_weight_that_integers_cannot_hold_is_refused_in_a_short_line_naming_the_spec(tmp_path):
    """A weight of 1e300 or 1e-300 (a positive number that rounds to 0 at the weights' 1/1000) is
    refused in one short line that says what happened — not "must be positive numbers" for a
    positive number, not a 600-digit integer — and, from a spec file, naming the file."""
    for name in ("web", "books"):
        crossfeed.write_dataset(tmp_path / name, [{"x": i} for i in range(8)]).close()
    for w, what in ((1e300, "too fine-grained"), (1e-300, "rounds to 0")):
        with pytest.raises(ConfigError, match=what) as e:
            crossfeed.Loader(
                [crossfeed.Source(tmp_path / "web", weight=w), crossfeed.Source(tmp_path / "books")], batch_size=4
            )
        assert len(str(e.value)) < 300, str(e.value)
        spec = tmp_path / "mix.json"
        spec.write_text(json.dumps({"sources": [{"path": "web", "weight": w}, {"path": "books"}]}))
        res = CliRunner().invoke(app, ["replay", str(spec), "--step", "0"])
        assert res.exit_code == 2 and what in res.stderr and str(spec) in res.stderr, res.output
        assert len(res.stderr) < 400, res.stderr


def test_weights_from_a_text_feature_or_over_nan_labels_are_refused_by_name(tmp_path):
    """`crossfeed weights --feature` on a text feature, and `--balance` over a float label holding
    NaN (which equals no class, not even itself), are refused in one line naming the feature —
    they were a raw TypeError and a raw KeyError."""
    root = tmp_path / "n"
    samples = [{"x": i, "c": float("nan") if i % 3 == 0 else float(i % 2), "s": "ab"[i % 2]} for i in range(9)]
    crossfeed.write_dataset(root, samples).close()
    res = CliRunner().invoke(app, ["weights", str(root), "--feature", "s"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "feature 's'" in res.stderr and "numeric" in res.stderr
    res = CliRunner().invoke(app, ["weights", str(root), "--balance", "c"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "'c'" in res.stderr and "NaN" in res.stderr
    assert not (root / "weights" / "balance-c.json").exists()
    crossfeed.write_weights(root, balance="s")  # a text label balances
    got = _read(root, weights="balance-s", samples_per_epoch=40)  # one whole pass of 2 × lcm(5, 4) slots
    assert sum(x % 2 == 0 for x in got) == sum(x % 2 == 1 for x in got) == 20  # 'a' and 'b' alike


def test_a_state_saved_on_an_earlier_version_says_which_version_to_resume_on(tmp_path):
    """A state saved on version 1 of a dataset that has grown since is refused on the newest
    version (another stream), and the refusal says how to go on: resume on ``path@v1``."""
    root = tmp_path / "daily"
    crossfeed.write_dataset(root, [{"x": i} for i in range(8)]).close()
    with crossfeed.Loader(root, batch_size=2, seed=0) as loader:
        next(iter(loader))
        state = loader.state_dict()
    crossfeed.write_dataset(root, [{"x": 100 + i} for i in range(4)], append=True).close()
    with crossfeed.Loader(root, batch_size=2, seed=0) as loader:
        with pytest.raises(ConfigError, match=f"saved on version 1 of {root}: resume on '{root}@v1'"):
            loader.load_state_dict(state)
    with crossfeed.Loader(f"{root}@v1", batch_size=2, seed=0) as loader:
        loader.load_state_dict(state)
        assert len([x for b in loader for x in b["x"]]) == 6


def test_a_state_whose_epoch_or_position_is_not_an_integer_is_refused(tmp_path):
    """A state's epoch 1.5 or position "5" (damaged or hand-edited) is refused by name; it was
    taken silently as epoch 1 / position 5."""
    root = _weighted(tmp_path / "d")
    with crossfeed.Loader(root, batch_size=2, seed=0) as loader:
        next(iter(loader))
        state = loader.state_dict()
    for field, value in (("epoch", 1.5), ("position", "2"), ("epoch", True)):
        with crossfeed.Loader(root, batch_size=2, seed=0) as loader:
            with pytest.raises(ConfigError, match=f"{field}"):
                loader.load_state_dict({**state, field: value})
    with crossfeed.Loader(root, batch_size=2, seed=0) as loader:
        loader.load_state_dict({**state, "position": np.int64(2)})  # a numpy integer is an integer


def test_replay_with_a_state_follows_a_phase_appended_on_resume(tmp_path):
    """A run that appended a phase on resume (allowed: docs/read-and-mix.md, "Appending a phase to
    a running plan") is replayed from its new spec file and the checkpoint it resumed from — the
    replay allows exactly what `load_state_dict` allows (it refused the new schedule as another
    stream), and still refuses a change to a phase that had begun, naming it."""
    for name, n in (("web", 40), ("books", 20)):
        crossfeed.write_dataset(tmp_path / name, [{"x": i} for i in range(n)]).close()

    def spec(web, books):
        return {
            "sources": [
                {"path": str(tmp_path / "web"), "weight": {"constant": web}},
                {"path": str(tmp_path / "books"), "weight": {"constant": books}},
            ],
            "samples_per_epoch": 64,
        }

    base = tmp_path / "base.json"
    base.write_text(json.dumps(spec([[0, 3], [40, 1]], [[0, 1], [40, 3]])))
    sources, n = load_mixture_spec(base)
    with crossfeed.Loader(sources, batch_size=8, seed=0, samples_per_epoch=n) as loader:
        it = iter(loader)
        for _ in range(6):  # 48 samples: phase 1 (from sample 40) has begun
            next(it)
        state = loader.state_dict()
    (tmp_path / "state.json").write_text(json.dumps(state))
    more = tmp_path / "more.json"
    more.write_text(json.dumps(spec([[0, 3], [40, 1], [96, 1]], [[0, 1], [40, 3], [96, 0]])))
    sources, n = load_mixture_spec(more)
    with crossfeed.Loader(sources, batch_size=8, seed=0, samples_per_epoch=n, return_index=True) as loader:
        loader.load_state_dict(state)
        delivered = [b["__index__"].tolist() for b in loader]  # steps 6 and 7 of epoch 0
    run = CliRunner().invoke
    res = run(app, ["replay", str(more), "--state", str(tmp_path / "state.json"), "--step", "7", "--json"])
    assert res.exit_code == 0, res.output
    assert [json.loads(line)["index"] for line in res.stdout.splitlines()] == delivered[1]
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(spec([[0, 3], [40, 2]], [[0, 1], [40, 3]])))
    res = run(app, ["replay", str(changed), "--state", str(tmp_path / "state.json"), "--step", "7"])
    assert res.exit_code == 2 and "phase 1 (from sample 40, weights [1, 3]) began before" in res.stderr, res.output


def test_a_weights_set_from_before_an_append_says_the_command_that_writes_it_again(tmp_path):
    """A weights set computed before an append (or any change of the manifest) is refused, and the
    refusal gives the very command that writes it again — its feature, resolution and name, or
    its class label — not a template with F to fill in."""
    root = tmp_path / "daily"
    samples = [{"x": i, "w": i % 3 / 2, "label": i % 2} for i in range(8)]
    crossfeed.write_dataset(root, samples).close()
    crossfeed.write_weights(root, feature="w", resolution=1000, name="half")
    crossfeed.write_weights(root, balance="label")
    crossfeed.write_dataset(root, samples[:4], append=True).close()
    for name, command in (
        ("half", f"crossfeed weights {root} --feature w --resolution 1000 --name half"),
        (crossfeed.balanced("label"), f"crossfeed weights {root} --balance label"),
    ):
        with pytest.raises(ConfigError, match="computed for another version") as e:
            _read(root, weights=name)
        assert command in str(e.value), str(e.value)
        res = CliRunner().invoke(app, command.split()[1:])
        assert res.exit_code == 0, res.output
        assert len(_read(root, weights=name)) == 12


def test_writing_to_path_at_a_version_of_a_dataset_is_refused(tmp_path):
    """``convert … cv@v1 --append`` (or any write to ``DATASET@vN``) made a new dataset in a
    directory named ``cv@v1`` — which then shadowed version 1 of ``cv`` for every reader (a path
    that exists as spelled is read as it is). It is refused, naming the dataset to append to."""
    root = _appended(tmp_path / "cv")
    target = f"{root}@v1"
    for kw in ({"append": True}, {}):
        with pytest.raises(ConfigError, match=f"names version 1 of the dataset {root}"):
            crossfeed.write_dataset(target, [{"x": 1}], **kw).close()
    assert not os.path.exists(target)
    assert _read(target) == list(range(8))  # still version 1 of cv
    (tmp_path / "t.csv").write_text("x\n1\n2\n")
    res = CliRunner().invoke(app, ["convert", "csv", str(tmp_path / "t.csv"), target, "--append"])
    assert res.exit_code == 2 and "names version 1 of the dataset" in res.stderr, res.output
    assert not os.path.exists(target)
    crossfeed.write_dataset(tmp_path / "free@v1", [{"x": 1}]).close()  # no dataset 'free': an ordinary name


@pytest.mark.parametrize("epoch", ["x", 1.5, -1, True])
def test_replay_refuses_a_state_whose_epoch_is_not_an_epoch(tmp_path, epoch):
    """``crossfeed replay --state`` with a damaged epoch names the file and the field (it was a raw
    ValueError traceback for "x", and 1.5 was taken as epoch 1)."""
    root = _weighted(tmp_path / "d")
    with crossfeed.Loader(root, batch_size=2, seed=0) as loader:
        next(iter(loader))
        state = loader.state_dict()
    path = tmp_path / "state.json"
    path.write_text(json.dumps({**state, "epoch": epoch}))
    res = CliRunner().invoke(app, ["replay", str(root), "--step", "1", "--state", str(path)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert str(path) in res.stderr and "epoch" in res.stderr


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    crossfeed.write_dataset(root / "a", [{"x": i, "w": i % 4} for i in range(23)], num_shards=3).close()
    crossfeed.write_dataset(root / "b", [{"x": 100 + i, "w": 1} for i in range(7)]).close()
    crossfeed.write_weights(root / "a", feature="w")
    return root


def _recipe(root, kind):
    if kind == "weighted":
        return root / "a", {"weights": "w", "samples_per_epoch": 29}
    sched = Schedule.constant([(0, 3), (13, 1), (40, 2)])
    ramp = Schedule.linear([(0, 1), (50, 3)], every=7)
    return [crossfeed.Source(root / "a", weight=sched), crossfeed.Source(root / "b", weight=ramp)], {
        "samples_per_epoch": 29
    }


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["weighted", "scheduled"]),
    world=st.integers(1, 4),
    batch=st.integers(1, 6),
    shuffle=st.sampled_from(["global", "block", "none"]),
    drop_last=st.booleans(),
    seed=st.integers(0, 3),
    cut=st.integers(0, 40),
    world2=st.integers(1, 4),
    batch2=st.integers(1, 6),
)
def test_weighted_and_scheduled_steps_replay_what_iteration_delivered_also_after_an_elastic_resume(
    recipes, kind, world, batch, shuffle, drop_last, seed, cut, world2, batch2
):
    """Every step of every rank of a weighted or scheduled run, over two epochs, is what
    `batch_at` names; after a resume at any position under another world size and batch size, each
    rank's steps are what ``batch_at(k, epoch=, position=state["position"])`` names."""
    src, kw = _recipe(recipes, kind)
    opts = dict(batch_size=batch, shuffle=shuffle, drop_last=drop_last, seed=seed, return_index=True, **kw)
    state = None
    for rank in range(world):
        with crossfeed.Loader(src, rank=rank, world_size=world, **opts) as loader:
            step, seen = 0, 0
            for epoch in range(2):
                for got in loader:
                    assert [s.index for s in loader.batch_at(step)] == got["__index__"].tolist()
                    step += 1
                    seen += 1
                    if rank == 0 and epoch == 1 and state is None and seen * batch * world >= cut:
                        state = loader.state_dict()
    if state is None:
        return
    opts2 = {**opts, "batch_size": batch2}
    for rank in range(world2):
        with crossfeed.Loader(src, rank=rank, world_size=world2, **opts2) as loader:
            loader.load_state_dict(state)
            for k, got in enumerate(loader):
                want = loader.batch_at(k, epoch=state["epoch"], position=state["position"])
                assert [s.index for s in want] == got["__index__"].tolist()


def test_a_damaged_weights_file_says_the_command_that_writes_it_again(tmp_path):
    """Prefix sums cut short or edited (a write killed between the ``.cw`` file and the set's
    description leaves them disagreeing too) are refused naming the file and the exact command."""
    root = _weighted(tmp_path / "d")
    cw = root / "weights" / "w.train.cw"
    good = cw.read_bytes()
    for damaged in (good[:-8], good[:-8] + (2**40).to_bytes(8, "little")):
        cw.write_bytes(damaged)
        with pytest.raises(IndexFileError, match="w.train.cw") as e:
            _read(root, weights="w")
        assert f"crossfeed weights {root} --feature w`" in str(e.value), str(e.value)


def test_a_sources_features_that_are_not_names_are_refused_by_name(tmp_path):
    """A mixture spec file's (or a `Source`'s) ``features`` holding something else than feature
    names (``[[]]``, ``[1]``) is refused naming the source — it was a raw TypeError (unhashable list)."""
    for name in ("web", "books"):
        crossfeed.write_dataset(tmp_path / name, [{"x": i} for i in range(8)]).close()
    for bad in ([[]], [1], [None]):
        with pytest.raises(ConfigError, match="features must be a list of feature names"):
            crossfeed.Source(tmp_path / "web", features=bad)
        spec = tmp_path / "mix.json"
        spec.write_text(json.dumps({"sources": [{"path": "web", "features": bad}, {"path": "books"}]}))
        res = CliRunner().invoke(app, ["replay", str(spec), "--step", "0"])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert str(spec) in res.stderr and "source 0" in res.stderr


def test_a_negative_weight_is_named_by_its_record_in_the_split_not_in_its_chunk(tmp_path, monkeypatch):
    """Weights are computed a chunk of records at a time: a negative weight past the first chunk
    is named by its record number in the split (it was its number within the chunk)."""
    from crossfeed.read.tools import weights as tool

    monkeypatch.setattr(tool, "CHUNK", 4)
    root = tmp_path / "d"
    crossfeed.write_dataset(root, [{"x": i, "w": -1 if i == 9 else 1} for i in range(12)]).close()
    with pytest.raises(ConfigError, match="weight -1 of record 9 is negative"):
        crossfeed.write_weights(root, feature="w")


def test_writing_weights_split_by_split_keeps_the_sets_other_splits(tmp_path):
    """``crossfeed weights D --feature w --split validation`` after ``--split train`` adds the
    validation split to the set — the train split's weights stay (they were dropped from the set,
    silently, so a train Loader then found no split 'train'). A set of another definition (another
    feature) replaces the whole set."""
    root = tmp_path / "d"
    crossfeed.write_dataset(root, [{"x": i, "w": i % 3, "v": 1} for i in range(9)]).close()
    crossfeed.write_dataset(
        root, [{"x": 100 + i, "w": 1, "v": 1} for i in range(4)], split="validation", add_split=True
    ).close()
    run = CliRunner().invoke
    for split in ("train", "validation"):
        res = run(app, ["weights", str(root), "--feature", "w", "--split", split])
        assert res.exit_code == 0, res.output
    assert _read(root, weights="w", samples_per_epoch=9) == [1, 2, 2, 4, 5, 5, 7, 8, 8]
    assert _read(root, weights="w", split="validation") == [100, 101, 102, 103]
    res = run(app, ["weights", str(root), "--feature", "v", "--name", "w", "--split", "validation"])
    assert res.exit_code == 0, res.output
    with pytest.raises(ConfigError, match="has no split 'train'"):
        _read(root, weights="w")


@requires("grain")
def test_grains_mix_of_a_scheduled_mixture_is_refused_by_name(tmp_path):
    """`crossfeed.adapters.grain.mix` hands the sources' weights to Grain's fixed-weight mix: a
    source weighted by a `Schedule` is refused naming it and the way on (a raw TypeError before);
    fixed ``weights=`` given instead mix as usual."""
    from crossfeed.adapters.grain import GrainSource, mix

    for name in ("web", "books"):
        crossfeed.write_dataset(tmp_path / name, [{"x": i} for i in range(8)]).close()
    src = GrainSource(
        [
            crossfeed.Source(tmp_path / "web", weight=Schedule.constant([(0, 3), (16, 1)])),
            crossfeed.Source(tmp_path / "books"),
        ]
    )
    with pytest.raises(ConfigError, match="source 0 is weighted by a Schedule"):
        mix(src, seed=1)
    assert len([mix(src, seed=1, weights=[3, 1])[i]["x"] for i in range(4)]) == 4


def test_process_workers_read_the_version_their_loader_opened_through_an_append(tmp_path):
    """A Loader opened on version 1 goes on reading version 1 when the dataset is appended to
    meanwhile (docs/convert.md, "Growing datasets") — also with worker processes, which open the
    dataset again: they open the version planned on (they raised DatasetRewrittenError, as for an
    overwrite), for one dataset and for a mixture's sources."""
    root = tmp_path / "daily"
    crossfeed.write_dataset(root, [{"x": i, "s": f"v{i}"} for i in range(8)], num_shards=2).close()
    crossfeed.write_dataset(tmp_path / "b", [{"x": 50 + i, "s": "b"} for i in range(4)]).close()
    opts = dict(batch_size=2, shuffle="none", executor="process", processes=1)
    mixture = [crossfeed.Source(root, weight=2), crossfeed.Source(tmp_path / "b")]  # 8 and 4 of 12 draws
    with crossfeed.Loader(root, **opts) as one, crossfeed.Loader(mixture, **opts) as mix:
        crossfeed.write_dataset(root, [{"x": 100 + i, "s": "n"} for i in range(4)], append=True).close()
        assert sorted(int(x) for b in one for x in b["x"]) == list(range(8))
        assert sorted(int(x) for b in mix for x in b["x"]) == [*range(8), *range(50, 54)]
    with crossfeed.Loader(root, **opts) as now:  # opened after the append: version 2
        assert sorted(int(x) for b in now for x in b["x"]) == [*range(8), *range(100, 104)]


def test_replay_names_a_pinned_versions_files_within_their_dataset(tmp_path):
    """``crossfeed replay`` of a mixture of ``daily@v1`` and ``daily`` prints each file within its
    dataset for both sources (the pinned source's files were printed as full paths) and names the
    source by its version."""
    root = _appended(tmp_path / "daily")
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"sources": [{"path": "daily@v1"}, {"path": "daily"}], "samples_per_epoch": 8}))
    res = CliRunner().invoke(app, ["replay", str(spec), "--step", "0", "--batch-size", "8"])
    assert res.exit_code == 0, res.output
    rows = [line.split() for line in res.stdout.splitlines()[2:]]
    assert {r[1] for r in rows} == {"0:daily@v1", "1:daily"}
    assert all(not r[2].startswith("/") and r[2].endswith(".tfrecord") for r in rows), res.stdout
    assert str(root) not in res.stdout
