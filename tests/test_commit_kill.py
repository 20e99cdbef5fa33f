"""A commit is atomic: a writer SIGKILLed after any step of it (a real forked process, killed by the
``CROSSFEED_TEST_CRASH_AT`` crash points of `crossfeed.write.writer`) leaves a dataset that opens
and reads as the complete old version or the complete new one, never a mix; the next write
leaves no temporary or orphaned file behind."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import crossfeed
from crossfeed.format.manifest import MANIFEST

pytestmark = pytest.mark.slow  # kill -9 at every step of a commit


def _write_new(root, base: int, mode: str) -> None:
    def samples(split, n):
        return [{"x": np.full(3, base + i, np.int16), "split": split} for i in range(n)]

    if mode == "overwrite":  # replaces both splits of the old version
        crossfeed.write_dataset(root, samples("train", 7), split="train", num_shards=1, overwrite=True).close()
    else:  # adds a split to the old version
        crossfeed.write_dataset(
            root, samples("validation", 5), split="validation", num_shards=1, add_split=True
        ).close()


OLD = {"train": list(range(0, 6)), "validation": list(range(100, 104))}


def _old_version(root):
    crossfeed.write_dataset(
        root, [{"x": np.full(3, v, np.int16), "split": "train"} for v in OLD["train"]], num_shards=2
    ).close()
    crossfeed.write_dataset(
        root,
        [{"x": np.full(3, v, np.int16), "split": "validation"} for v in OLD["validation"]],
        split="validation",
        num_shards=1,
        add_split=True,
    ).close()


def _contents(root) -> dict[str, list[int]]:
    """Every split's samples, read in full with every index and frame check on."""
    with crossfeed.open_dataset(root) as ds:
        return {name: sorted(int(s["x"][0]) for s in ds[name]) for name in ds.splits}


def _run(root, k: int, base: int, mode: str) -> int:
    """Run the write in a forked child that SIGKILLs itself after step ``k``; its wait status."""
    pid = os.fork()
    if pid == 0:  # the child: a real process, killed for real
        code = 1
        try:
            os.environ["CROSSFEED_TEST_CRASH_AT"] = str(k)
            _write_new(root, base, mode)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _leftovers(root) -> list[str]:
    with crossfeed.open_dataset(root) as ds:
        named = {MANIFEST} | ds.manifest.files
    return sorted(set(os.listdir(root)) - named)


@pytest.mark.parametrize("mode", ["overwrite", "add_split"])
def test_kill_at_every_step_of_a_commit_leaves_old_or_new(tmp_path, mode):
    if mode == "overwrite":  # old: train + validation; new: a train written over all of it
        old, new = OLD, {"train": list(range(1000, 1007))}
    else:  # old: train; new: train + an added validation
        old, new = {"train": OLD["train"]}, {"train": OLD["train"], "validation": list(range(1000, 1005))}
    seen = set()
    for k in range(1, 100):
        root = tmp_path / f"{k}"
        if mode == "overwrite":
            _old_version(root)
        else:
            crossfeed.write_dataset(
                root, [{"x": np.full(3, v, np.int16), "split": "train"} for v in OLD["train"]], num_shards=2
            ).close()
        status = _run(root, k, 1000, mode)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:  # k is past the last step: the whole write ran
            assert k > 5, "the crash points were never reached"
            assert _contents(root) == new and _leftovers(root) == []
            break
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        got = _contents(root)  # opens, and every record of every split reads
        assert got in (old, new), (k, got)
        seen.add("new" if got == new else "old")
        # the next write (a full rewrite, in this process) cleans up what the dead one left
        crossfeed.write_dataset(
            root, [{"x": np.full(3, 3000 + i, np.int16), "split": "train"} for i in range(7)], overwrite=True
        ).close()
        assert _contents(root) == {"train": list(range(3000, 3007))}
        assert _leftovers(root) == [], (k, _leftovers(root))
    else:
        pytest.fail("the writer never finished")
    assert seen == {"old", "new"}  # kills landed both before and after the commit point


def test_a_first_write_killed_at_any_step_leaves_nothing_or_the_dataset(tmp_path):
    for k in range(1, 100):
        root = tmp_path / f"{k}"
        status = _run(root, k, 1000, "overwrite")
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            assert k > 3
            break
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        try:
            got = _contents(root)
        except crossfeed.DatasetNotFoundError:  # killed before the commit point: no dataset at all
            got = None
        assert got in (None, {"train": list(range(1000, 1007))}), (k, got)
        # a plain rerun (no overwrite) works when there is no dataset: what the dead writer left,
        # orphaned shards included, is not "a non-empty directory"
        crossfeed.write_dataset(root, [{"v": i} for i in range(3)], overwrite=got is not None).close()
        assert _leftovers(root) == [], (k, _leftovers(root))
    else:
        pytest.fail("the writer never finished")


def test_stale_temporaries_of_a_dead_writer_go_but_a_live_writers_stay(tmp_path):
    from crossfeed.write.commit import dataset_lock, remove_stale, writer_lock
    from crossfeed.write.staging import TMP_PREFIX

    root = tmp_path / "d"
    crossfeed.write_dataset(root, [{"v": i} for i in range(4)]).close()
    (root / f"{TMP_PREFIX}dead00-train-00000.tfrecord").write_bytes(b"x")
    (root / f"{TMP_PREFIX}dead00.lock").write_bytes(b"")
    with writer_lock(str(root), "live00"):
        (root / f"{TMP_PREFIX}live00-train-00000.tfrecord").write_bytes(b"y")
        with dataset_lock(str(root)):
            remove_stale(str(root))
        names = set(os.listdir(root))
        assert f"{TMP_PREFIX}live00-train-00000.tfrecord" in names
        assert not any("dead00" in n for n in names)
