"""A version delta view (``path@v2-v1``, ``open_dataset(path, version=2, since=1)``): only the
shards a version appended. Its identity is both versions' manifests; it is refused when the two
versions are not an append chain. In a mixture with the old version and a schedule that brings the
delta in from a step onward, every sample of the new version arrives exactly once per pass, and a
resume across the boundary step is exact."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from recipe_helpers import day, xs

import crossfeed
from crossfeed import Schedule, Source
from crossfeed.errors import ConfigError
from crossfeed.format.manifest import MANIFEST


@pytest.fixture()
def grown(tmp_path):
    root = str(tmp_path / "ds")
    crossfeed.write_dataset(root, day(0, 12), num_shards=2).close()
    crossfeed.write_dataset(root, day(100, 6), num_shards=2, append=True).close()
    return root


def test_a_delta_view_holds_what_a_version_appended_and_names_both_versions(grown):
    with (
        crossfeed.open_dataset(grown + "@v2-v1") as delta,
        crossfeed.open_dataset(grown, version=2, since=1) as same,
        crossfeed.open_dataset(grown, since=1) as newest,
    ):
        assert xs(delta) == xs(same) == xs(newest) == list(range(100, 106))
        assert delta.path == os.path.abspath(grown) + "@v2-v1" and delta.version == 2 and delta.since_version == 1
    crossfeed.write_dataset(grown, day(200, 3), append=True).close()  # v3
    with crossfeed.open_dataset(grown + "@v3-v1") as d31, crossfeed.open_dataset(grown + "@v2-v1") as d21:
        assert xs(d31) == list(range(100, 106)) + list(range(200, 203))
        assert xs(d21) == list(range(100, 106))  # pinned: the same view after another append
        assert d21.path.endswith("@v2-v1")
    for bad, match in [
        (grown + "@v2-v2", "since= must be a version from 1"),
        (grown + "@v1-v2", "since= must be a version from 1"),
        (grown + "@v9-v1", "no version 9"),
    ]:
        with pytest.raises(ConfigError, match=match):
            crossfeed.open_dataset(bad)
    with pytest.raises(ConfigError, match="since=2 another"):
        crossfeed.open_dataset(grown + "@v3-v1", since=2)


def test_the_delta_identity_is_both_manifests_and_a_state_on_it_resumes_after_another_append(grown):
    kw = dict(batch_size=2, seed=1)
    with crossfeed.Loader(grown + "@v2-v1", **kw) as loader:
        ident = loader.pipeline.identity.settings["dataset"]
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        rest = [b["x"].tolist() for b in it]
    with crossfeed.open_dataset(grown) as v2, crossfeed.open_dataset(grown + "@v1") as v1:
        assert ident == f"sha256:{v2.manifest_sha256} since sha256:{v1.manifest_sha256}"
    crossfeed.write_dataset(grown, day(200, 3), append=True).close()  # v3 meanwhile: the view is the same
    with crossfeed.Loader(grown + "@v2-v1", **kw) as again:
        again.load_state_dict(state)
        assert [b["x"].tolist() for b in again] == rest
    with crossfeed.Loader(grown + "@v3-v1", **kw) as other, pytest.raises(ConfigError, match="dataset was"):
        other.load_state_dict(state)


def test_a_delta_of_versions_that_are_no_append_chain_is_refused(grown):
    # version 2's manifest rewritten so that its train split no longer begins with version 1's shards
    path = os.path.join(grown, MANIFEST)
    with open(path) as f:
        m = json.load(f)
    m["splits"]["train"]["shards"].reverse()
    with open(path, "w") as f:
        json.dump(m, f)
    with pytest.raises(ConfigError, match="not an append chain"):
        crossfeed.open_dataset(grown + "@v2-v1")
    crossfeed.write_dataset(grown, day(0, 2), overwrite=True).close()  # the history is gone
    with pytest.raises(ConfigError, match="no version 2"):
        crossfeed.open_dataset(grown + "@v2-v1")


S, BATCH, EPOCH = 12, 3, 18  # the new data from sample 12 (step 4); an epoch of 18 samples, 6 steps


def _bring_in(root):
    """Version 1 throughout, version 2's new shards from sample S on, weights 2:1 (their sizes)."""
    return [
        Source(root + "@v1", weight=Schedule.constant([(0, 1), (S, 2)])),
        Source(root + "@v2-v1", weight=Schedule.constant([(0, 0), (S, 1)])),
    ]


def _xs_of(batches) -> np.ndarray:
    return np.concatenate([np.asarray(b["x"]) for b in batches])


def test_new_data_comes_in_from_a_step_and_every_sample_of_v2_arrives_once_per_pass(grown):
    with crossfeed.Loader(_bring_in(grown), batch_size=BATCH, seed=4, samples_per_epoch=EPOCH) as loader:
        xs = _xs_of(loader.epochs(4))  # 72 samples
    v2 = list(range(12)) + list(range(100, 106))
    assert not (xs[:S] >= 100).any() and sorted(xs[:S]) == list(range(12))  # before S: version 1 only, one pass
    for lo in range(S, len(xs) - EPOCH + 1, EPOCH):  # from S on: each window of 18 is one pass of each source
        assert sorted(xs[lo : lo + EPOCH].tolist()) == v2, lo


def test_a_resume_across_the_boundary_step_is_exact_on_one_rank_or_two(grown):
    kw = dict(batch_size=BATCH, seed=4, samples_per_epoch=EPOCH)
    with crossfeed.Loader(_bring_in(grown), **kw) as loader:
        full = [b["x"].tolist() for b in loader.epochs(2)]
    for stop in (3, 4, 5, 8):  # steps before, at and after the boundary (step 4), and in the next epoch
        with crossfeed.Loader(_bring_in(grown), **kw) as first:
            it = iter(first.epochs(2))
            for _ in range(stop):
                next(it)
            state = first.state_dict()
        with crossfeed.Loader(_bring_in(grown), **kw) as again:
            again.load_state_dict(state)
            assert [b["x"].tolist() for b in again.epochs(2 - state["epoch"])] == full[stop:], stop
        # elastic: two ranks take the rest of the epoch strided, in lockstep
        ranks = []
        for r in range(2):
            with crossfeed.Loader(_bring_in(grown), **kw, rank=r, world_size=2) as loader:
                loader.load_state_dict(state)
                ranks.append([x for b in loader for x in b["x"].tolist()])
        rest = [x for b in full[stop : (state["epoch"] + 1) * (EPOCH // BATCH)] for x in b]
        merged = [x for pair in zip(*ranks) for x in pair]
        even = len(rest) // 2 * 2
        assert merged[:even] == rest[:even], stop
