"""Nested mixtures (`crossfeed.read.sources.nested`): a `Source` whose path is a mixture (a list of
sources or a spec file) is flattened into leaf sources before planning. Every leaf stays within one
sample of its share over every prefix of every phase, every group within as many samples as it
has leaves; the Loader reads the leaves as a flat mixture (resume, identity, spec files)."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loader_helpers import assert_resumes_identically, ids_of

import crossfeed
from crossfeed import Schedule, Source
from crossfeed.errors import ConfigError
from crossfeed.format.schema import SOURCE_KEY
from crossfeed.read.options import PlanOptions, ShardOptions
from crossfeed.read.sources import nested
from crossfeed.read.sources.mixture_file import load_mixture_spec
from crossfeed.read.stages.sampler import Sampler

TOTAL = 240  # global samples checked


def _weight(draw):
    """A fixed weight 1–4 or a constant schedule of 1–3 phases (weights 0–4, boundaries < TOTAL)."""
    if draw(st.booleans()):
        return draw(st.integers(1, 4))
    bounds = sorted(set(draw(st.lists(st.integers(1, TOTAL - 1), max_size=2))))
    return Schedule.constant([(0, draw(st.integers(0, 4)))] + [(b, draw(st.integers(0, 4))) for b in bounds])


def _tree(draw, depth: int, names: list) -> list:
    """A mixture of 1–3 entries, each a leaf or (above the last level) a nested mixture."""
    out = []
    for _ in range(draw(st.integers(1 if depth else 2, 3))):
        if depth < 2 and draw(st.integers(0, 2)) == 0:
            out.append(Source(_tree(draw, depth + 1, names), weight=_weight(draw)))
        else:
            names.append(f"leaf{len(names)}")
            out.append(Source(names[-1], weight=_weight(draw)))
    return out


def _value(w, g: int) -> Fraction:
    if not isinstance(w, Schedule):
        return Fraction(w)
    return Fraction([v for a, v in w.points if a <= g][-1])


def _shares(tree, g: int, share=Fraction(1)) -> dict:
    """Each leaf's exact share of global sample ``g`` (by path), and each group's (its leaves')."""
    vals = [_value(s.weight, g) for s in tree]
    total = sum(vals)
    out: dict = {}
    for s, v in zip(tree, vals):
        mine = share * v / total if total else Fraction(0)
        if isinstance(s.path, tuple):
            out.update(_shares(s.path, g, mine))
        else:
            out[s.path] = mine
    return out


def _groups(tree, prefix=()) -> list[list[str]]:
    """Every group's leaves (the whole mixture's too)."""
    mine: list[str] = []
    out = []
    for k, s in enumerate(tree):
        if isinstance(s.path, tuple):
            inner = _groups(s.path, (*prefix, k))
            out += inner
            mine += inner[-1]
        else:
            mine.append(s.path)
    return [*out, mine]


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_every_prefix_of_every_phase_keeps_leaves_within_one_and_groups_within_their_leaves(data):
    names: list = []
    tree = _tree(data.draw, 0, names)
    try:
        leaves = nested.flatten(tree)
        plan = PlanOptions(batch_size=1, samples_per_epoch=TOTAL)
        sampler = Sampler(
            [[1 + i] for i in range(len(leaves))], plan, ShardOptions(), weights=[s.weight for s in leaves]
        )
    except ConfigError as e:  # a moment where nothing (or no source of a drawn group) weighs
        assert "weighted 0" in str(e) or "too fine-grained" in str(e)  # or more than MAX_PERIOD as integers
        return
    assert [s.path for s in leaves] == names
    order = sampler.plan(0).order
    src = order.source_of(np.arange(TOTAL))
    # the exact shares, from the tree itself (not the flattening): a phase is a run of samples over
    # which every share is the same
    shares = [_shares(tree, g) for g in range(TOTAL)]
    cuts = [0] + [g for g in range(1, TOTAL) if shares[g] != shares[g - 1]] + [TOTAL]
    groups = _groups(tree)
    index = {n: i for i, n in enumerate(names)}
    for lo, hi in zip(cuts, cuts[1:]):
        seg = src[lo:hi]
        counts = np.cumsum(seg[:, None] == np.arange(len(names))[None, :], axis=0)
        prefix = np.arange(1, hi - lo + 1)
        for members in groups:
            cols = [index[n] for n in members]
            exact = float(sum(shares[lo][n] for n in members)) * prefix
            got = counts[:, cols].sum(axis=1)
            assert np.abs(got - exact).max() < len(members), (lo, members)
        for n in names:
            if shares[lo][n] == 0:
                assert not counts[:, index[n]].any()  # weighed 0 there: never drawn


def test_fixed_weights_flatten_to_integer_leaves_and_a_flat_mixture_is_untouched():
    flat = [Source("a", weight=0.5), Source("b", weight=2)]
    assert nested.flatten(flat) == tuple(flat)
    tree = [Source("a", weight=1), Source([Source("b", weight=1), Source("c", weight=2)], weight=1)]
    assert [(s.path, s.weight) for s in nested.flatten(tree)] == [("a", 3), ("b", 1), ("c", 2)]
    # a deeper nesting that is equivalent flattens to the same leaves
    again = [Source([Source("a")], weight=3), Source([Source([Source("b")]), Source("c", weight=2)], weight=3)]
    assert nested.flatten(again) == nested.flatten(tree)


def test_a_linear_factor_keeps_its_step_function_and_the_product_is_a_constant_schedule():
    ramp = Schedule.linear([(0, 1), (100, 3)], every=25)
    tree = [
        Source("a", weight=Schedule.constant([(0, 0), (10, 1)])),
        Source([Source("b"), Source("c", weight=ramp)], weight=2),
    ]
    got = {s.path: s.weight for s in nested.flatten(tree)}
    assert all(w.kind == "constant" for w in got.values())
    for g in (0, 10, 24, 25, 60, 99, 100, 500):
        c = Fraction(dict(ramp.pieces())[max(a for a, _ in ramp.pieces() if a <= g)]).limit_denominator(1000)
        exact = {"a": Fraction(int(g >= 10)), "b": 2 / (1 + c), "c": 2 * c / (1 + c)}
        now = {k: _value(w, g) for k, w in got.items()}
        total = sum(now.values())
        assert {k: v / total for k, v in now.items()} == {k: v / sum(exact.values()) for k, v in exact.items()}, g


def test_nesting_is_bounded_and_groups_take_only_a_weight(tmp_path):
    with pytest.raises(ConfigError, match="non-empty list of crossfeed.Source"):
        Source([])
    with pytest.raises(ConfigError, match="takes only weight="):
        Source([Source("a")], split="test")
    deep = Source("x")
    for _ in range(nested.MAX_DEPTH + 1):
        deep = Source([deep, Source("y")])
    with pytest.raises(ConfigError, match="nested more than"):
        nested.flatten([deep])
    wide = [Source([Source(f"s{i}") for i in range(nested.MAX_LEAVES)]), Source("one more")]
    with pytest.raises(ConfigError, match=f"more than {nested.MAX_LEAVES} sources"):
        nested.flatten(wide)
    me = tmp_path / "me.json"  # a spec file naming itself
    me.write_text(json.dumps({"sources": [{"path": "me.json"}, {"path": "data/"}]}))
    with pytest.raises(ConfigError, match="nested more than"):
        load_mixture_spec(me)
    with pytest.raises(ConfigError, match="weighted 0 while the group itself"):
        nested.flatten([Source("a"), Source([Source("b", weight=Schedule.constant([(0, 1), (5, 0)]))])])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sources": [{"mixture": [{"path": "a/"}], "weight": 1, "split": "x"}]}))
    with pytest.raises(ConfigError, match="source 0 is a nested mixture"):
        load_mixture_spec(bad)


def _write(root, name: str, n: int, offset: int):
    samples = [{"x": np.full(2, offset + i, np.float32), "id": offset + i} for i in range(n)]
    crossfeed.write_dataset(root / name, samples, num_shards=2).close()
    return str(root / name)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("nested")
    return _write(root, "code", 12, 0), _write(root, "web", 20, 1000), _write(root, "books", 8, 2000)


KW = dict(batch_size=4, seed=5, samples_per_epoch=48, return_index=True)


def _nested(paths, at: int = 24):
    prose = [Source(paths[1], weight=3), Source(paths[2], weight=1)]
    return [Source(paths[0], weight=1), Source(prose, weight=Schedule.constant([(0, 1), (at, 3)]))]


def test_a_nested_mixture_reads_as_its_leaves_and_resumes_exactly(paths):
    with crossfeed.Loader(_nested(paths), **KW) as loader:
        assert [s.path for s in loader.sources] == list(paths)  # the leaves, in order
        src = np.concatenate([b[SOURCE_KEY] for b in loader.epochs(1)])
    # before sample 24: code 1/2, web 3/8, books 1/8; then code 1/4, web 9/16, books 3/16
    assert np.bincount(src[:24], minlength=3).tolist() == [12, 9, 3]
    assert np.abs(np.bincount(src[24:], minlength=3) - np.array([6, 13.5, 4.5])).max() < 1
    kw = {k: v for k, v in KW.items() if k != "return_index"}
    assert_resumes_identically(_nested(paths), stops=[0, 3, 6, 7, 12], **kw)


def test_an_equivalent_nesting_resumes_and_another_is_refused_by_name(paths):
    with crossfeed.Loader(_nested(paths), **KW) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        rest = ids_of(it)
    # the same leaves in the same proportions, nested otherwise: the same stream
    same = [
        Source([Source(paths[0])], weight=2),
        Source(
            [Source([Source(paths[1], weight=6)], weight=3), Source(paths[2], weight=1)],
            weight=Schedule.constant([(0, 2), (24, 6)]),
        ),
    ]
    with crossfeed.Loader(same, **KW) as again:
        again.load_state_dict(state)
        for a, b in zip(ids_of(again), rest, strict=True):
            np.testing.assert_array_equal(a, b)
    other = [Source(paths[0], weight=1), Source([Source(paths[1], weight=1), Source(paths[2], weight=1)])]
    with crossfeed.Loader(other, **KW) as loader, pytest.raises(ConfigError, match="source 0 weight was"):
        loader.load_state_dict(state)


def test_a_spec_file_nests_mixtures_and_other_spec_files(paths, tmp_path):
    inner = tmp_path / "prose.json"
    inner.write_text(json.dumps({"sources": [{"path": paths[1], "weight": 3}, {"path": paths[2]}]}))
    outer = tmp_path / "mix.json"
    outer.write_text(
        json.dumps(
            {
                "sources": [
                    {"path": paths[0]},
                    {"path": "prose.json", "weight": {"constant": [[0, 1], [24, 3]]}},
                ],
                "samples_per_epoch": 48,
            }
        )
    )
    sources, n = load_mixture_spec(outer)
    assert n == 48 and tuple(sources) == nested.flatten(_nested(paths))
    inline = tmp_path / "inline.json"
    inline.write_text(
        json.dumps(
            {
                "sources": [
                    {"path": paths[0]},
                    {
                        "mixture": [{"path": paths[1], "weight": 3}, {"path": paths[2]}],
                        "weight": {"constant": [[0, 1], [24, 3]]},
                    },
                ]
            }
        )
    )
    assert load_mixture_spec(inline)[0] == sources
    # a Source naming the spec file is the same group
    by_file = [Source(paths[0]), Source(str(inner), weight=Schedule.constant([(0, 1), (24, 3)]))]
    assert nested.flatten(by_file) == tuple(sources)
    assert Source.from_json(json.loads(json.dumps(_nested(paths)[1].to_json()))) == _nested(paths)[1]


def test_replay_names_a_nested_spec_files_leaves(paths, tmp_path):
    """``crossfeed replay NESTED.json --step N`` plans the flattened leaves: the step's samples are
    the ones the Loader over the nested Sources delivered, by leaf."""
    from typer.testing import CliRunner

    from crossfeed.cli.main import app

    spec = tmp_path / "mix.json"
    prose = {
        "mixture": [{"path": paths[1], "weight": 3}, {"path": paths[2]}],
        "weight": {"constant": [[0, 1], [24, 3]]},
    }
    spec.write_text(json.dumps({"sources": [{"path": paths[0]}, prose], "samples_per_epoch": 48}))
    with crossfeed.Loader(_nested(paths), **KW) as loader:
        batches = list(loader)
    for step in (2, 7):
        res = CliRunner().invoke(app, ["replay", str(spec), "--step", str(step), "-b", "4", "--seed", "5", "--json"])
        assert res.exit_code == 0, res.output
        got = [json.loads(line) for line in res.stdout.splitlines()]
        want = batches[step]
        assert [(x["source_index"], x["index"]) for x in got] == list(
            zip(want[SOURCE_KEY].tolist(), want["__index__"].tolist())
        )


@pytest.mark.slow
def test_worker_processes_build_the_nested_mixtures_leaves(paths):
    kw = {**KW, "samples_per_epoch": 24}
    with crossfeed.Loader(_nested(paths, at=12), **kw) as loader:
        want = ids_of(loader)
    with crossfeed.Loader(_nested(paths, at=12), **kw, executor="process", processes=1) as loader:
        got = ids_of(loader)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
