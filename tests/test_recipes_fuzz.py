"""Fuzzing issue 36's new parsers from outside: schedule JSON and mixture spec files, weights sets
(their description and prefix sums), an appended dataset's version list, and saved states of
weighted and scheduled Loaders. Whatever the input, only the `CrossfeedError` family escapes —
never a raw TypeError, OverflowError or IndexError — for a bounded number of examples each."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import crossfeed
from crossfeed.errors import ConfigError, CrossfeedError, IndexFileError
from crossfeed.format import weights as fw
from crossfeed.read.schedule import Schedule
from crossfeed.read.sources.mixture_file import load_mixture_spec
from crossfeed.read.stages.sampler import MixturePhases, mixture_phases

FUZZ = settings(
    max_examples=int(__import__("os").environ.get("FUZZ_N", "50")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=12,
)
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.sampled_from([0, 1, 2**62 - 1, 2**62, 2**63, 1e-300, 1e300]),
)
points = st.lists(st.lists(numbers, min_size=1, max_size=3), max_size=5)
schedules = st.one_of(
    json_values,
    st.builds(lambda p: {"constant": p}, points),
    st.builds(lambda p, e: {"linear": p, "every": e}, points, numbers),
    st.builds(  # well formed but extreme
        lambda at, w, e: {"linear": [[0, 1], [at, w]], "every": e},
        st.integers(1, 2**64),
        st.floats(0, 1e300),
        st.integers(1, 2**64),
    ),
)


@FUZZ
@given(weight=schedules, other=st.one_of(st.integers(1, 5), st.builds(lambda p: {"linear": p, "every": 3}, points)))
def test_schedule_json_and_its_phases_raise_only_config_errors(weight, other):
    """A source's weight as a spec file gives it: parsed, cut into phases with another source's,
    and planned (`MixturePhases`) — or refused with a `ConfigError`."""
    try:
        a = Schedule.from_json(weight)
        b = Schedule.from_json(other) if isinstance(other, dict) else other
        phases = mixture_phases([a, b])
        MixturePhases(phases).locate(np.array([0, 2**61], dtype=np.int64))
    except ConfigError:
        pass


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    crossfeed.write_dataset(root / "web", [{"x": i, "w": i % 4} for i in range(12)], num_shards=2).close()
    crossfeed.write_dataset(root / "books", [{"x": 100 + i, "w": 1} for i in range(6)]).close()
    crossfeed.write_dataset(root / "books", [{"x": 200 + i, "w": 2} for i in range(3)], append=True).close()
    crossfeed.write_weights(root / "web", feature="w")
    return root


@FUZZ
@given(
    spec=st.one_of(
        json_values,
        st.builds(
            lambda w0, w1, n, path: {
                "sources": [{"path": "web", "weight": w0}, {"path": path, "weight": w1}],
                "samples_per_epoch": n,
            },
            st.one_of(numbers, schedules),
            st.one_of(numbers, schedules),
            st.one_of(st.integers(-3, 2**64), json_scalars),
            st.sampled_from(["books", "books@v1", "books@v2", "books@v3", "books@v0", "books@v99999999"]),
        ),
    ),
    step=st.integers(0, 2**64),
)
def test_a_mixture_spec_file_is_loaded_and_replayed_or_refused_by_name(data, tmp_path, spec, step):
    """A spec file of any JSON, or of sources (pinned versions among them) with extreme weights,
    schedules and epoch sizes: loading it, making its Loader and replaying a step (the first, or
    one far away) raise only the `CrossfeedError` family."""
    path = data / "spec.json"
    path.write_text(json.dumps(spec))
    try:
        sources, n = load_mixture_spec(path)
        with crossfeed.Loader(sources, batch_size=4, seed=1, samples_per_epoch=n) as loader:
            loader.batch_at(0)
            loader.batch_at(step)
    except CrossfeedError:
        pass


def _meta(root) -> dict:
    return json.loads((root / "weights" / "w.json").read_text())


def _paths(d, prefix=()):
    """Every path into a JSON value (the keys and indexes leading to each part of it)."""
    yield prefix
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _paths(v, (*prefix, i))


def _set(d, path, value):
    if not path:
        return value
    d = copy.deepcopy(d)
    at = d
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return d


@FUZZ
@given(which=st.integers(0, 10**6), value=json_values, raw=st.binary(max_size=64))
def test_weights_json_parses_strictly(data, which, value, raw):
    """A weights set's description with any one part replaced by any JSON value, or any bytes:
    parsed, or an `IndexFileError` naming the file."""
    meta = _meta(data / "web")
    paths = list(_paths(meta))
    for text in (json.dumps(_set(meta, paths[which % len(paths)], value)).encode(), raw):
        try:
            fw.WeightsMeta.loads(text, "w.json")
        except IndexFileError as e:
            assert "w.json" in str(e)


@FUZZ
@given(
    which=st.integers(0, 10**6),
    value=json_values,
    entries=st.lists(st.integers(0, 2**64 - 1), max_size=14),
    consistent=st.booleans(),
)
def test_a_damaged_weights_set_is_refused_by_name(data, tmp_path, which, value, entries, consistent):
    """A weights set with a mutated description, or prefix sums of any uint64 values (with the
    description made to agree with them, size, digest and total, or not): the weighted Loader
    reads it or refuses it with a `CrossfeedError` — never a raw error from the mapped file."""
    root = tmp_path / "web"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(data / "web", root)
    meta = _meta(root)
    cw = root / "weights" / "w.train.cw"
    if entries:
        arr = np.asarray(entries, dtype=np.uint64)
        cw.write_bytes(arr.astype("<u8").tobytes())
        if consistent:
            meta["splits"]["train"].update(
                num_records=len(arr),
                total=int(arr[-1]),
                sha256=hashlib.sha256(arr.astype("<u8").tobytes()).hexdigest(),
            )
    else:
        paths = list(_paths(meta))
        meta = _set(meta, paths[which % len(paths)], value)
    (root / "weights" / "w.json").write_text(json.dumps(meta))
    try:
        with crossfeed.Loader(root, batch_size=4, seed=0, weights="w") as loader:
            for batch in loader:
                assert batch["x"].dtype.kind == "i"
            loader.batch_at(3)
    except CrossfeedError:
        pass


@FUZZ
@given(which=st.integers(0, 10**6), value=json_values, version=st.integers(-1, 4))
def test_a_damaged_version_list_is_refused_by_name(data, tmp_path, which, value, version):
    """An appended dataset's manifest with any part of its version fields (``dataset_version``,
    ``versions``) replaced by any JSON value: the current version and ``path@vN`` open and read,
    or raise only the `CrossfeedError` family."""
    root = tmp_path / "books"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(data / "books", root)
    manifest = json.loads((root / "crossfeed.json").read_text())
    part = {k: manifest[k] for k in ("dataset_version", "versions")}
    paths = list(_paths(part))
    part = _set(part, paths[which % len(paths)], value)
    if isinstance(part, dict):
        manifest.update(part)
    else:
        manifest["versions"] = part
    (root / "crossfeed.json").write_text(json.dumps(manifest))
    for path in (str(root), f"{root}@v{version}"):
        try:
            with crossfeed.Loader(path, batch_size=4, seed=0) as loader:
                list(loader)
        except CrossfeedError:
            pass


@FUZZ
@given(which=st.integers(0, 10**6), value=json_values, kind=st.sampled_from(["weights", "schedule"]))
def test_a_crafted_state_is_resumed_or_refused_by_name(data, which, value, kind):
    """A weighted or scheduled Loader's state with any one part replaced by any JSON value (a
    crafted or damaged checkpoint): `load_state_dict` and the next batch raise only the
    `CrossfeedError` family."""
    if kind == "weights":
        src, kw = data / "web", {"weights": "w", "samples_per_epoch": 20}
    else:
        src = [
            crossfeed.Source(data / "web", weight=Schedule.constant([(0, 3), (10, 1)])),
            crossfeed.Source(data / "books", weight=Schedule.linear([(0, 1), (30, 3)], every=5)),
        ]
        kw = {"samples_per_epoch": 20}
    with crossfeed.Loader(src, batch_size=4, seed=1, **kw) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    paths = list(_paths(state))
    crafted = _set(state, paths[which % len(paths)], value)
    try:
        with crossfeed.Loader(src, batch_size=4, seed=1, **kw) as loader:
            loader.load_state_dict(crafted)
            next(iter(loader), None)
    except CrossfeedError:
        pass


@FUZZ
@given(which=st.integers(0, 10**6), value=json_values, step=st.integers(0, 2**70), raw=st.booleans())
def test_replay_of_a_crafted_state_exits_with_one_line(data, tmp_path, which, value, step, raw):
    """``crossfeed replay --state`` of a weighted run's state with any one part replaced by any JSON
    value (or a file of any JSON at all), at any step: exit 0 or 2 (a one-line error), never a
    traceback."""
    from typer.testing import CliRunner

    from crossfeed.cli.main import app

    with crossfeed.Loader(data / "web", batch_size=4, seed=1, weights="w") as loader:
        next(iter(loader))
        state = loader.state_dict()
    paths = list(_paths(state))
    crafted = value if raw else _set(state, paths[which % len(paths)], value)
    path = tmp_path / "state.json"
    path.write_text(json.dumps(crafted))
    res = CliRunner().invoke(
        app, ["replay", str(data / "web"), "--weights", "w", "--state", str(path), "--step", str(step)]
    )
    assert res.exit_code in (0, 2) and "Traceback" not in res.output, res.output


@FUZZ
@given(
    source=st.fixed_dictionaries(
        {"path": st.sampled_from(["web", "books@v1", "books", "nowhere", "books@v9"])},
        optional={
            "split": json_values,
            "weight": st.one_of(numbers, schedules),
            "rename": json_values,
            "features": json_values,
        },
    ),
    step=st.integers(0, 50),
)
def test_a_spec_files_source_fields_are_loaded_or_refused_by_name(data, source, step):
    """A spec file's source with any split, weight, rename and features values (beside a plain
    second source): loaded, planned and replayed, or refused with the `CrossfeedError` family."""
    path = data / "spec2.json"
    path.write_text(json.dumps({"sources": [source, {"path": "books"}], "samples_per_epoch": 12}))
    try:
        sources, n = load_mixture_spec(path)
        with crossfeed.Loader(sources, batch_size=4, seed=1, samples_per_epoch=n) as loader:
            loader.samples_at(step)
    except CrossfeedError:
        pass
