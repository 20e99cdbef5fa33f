"""Nothing silent at the dispatcher: its journal carries the stream's identity, a journal of another
dataset or of a finished run is refused (a new run is explicit: --restart), no journal is written
without --journal, a server of another dataset is refused, and a trainer that gets nothing is told why."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest
from dispatch_helpers import HB, ROOT, TESTS, spawn, start_server, used, write_dataset
from net_helpers import stop, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # real dispatchers, servers and trainers

N, BATCH = 48, 4


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsid")
    a, b = str(root / "a"), str(root / "b")
    write_dataset(a, N)
    import numpy as np

    import crossfeed

    samples = [{"x": np.full((4,), -i, np.int64), "label": 1000 + i} for i in range(N)]
    crossfeed.write_dataset(b, samples, num_shards=3).close()
    return a, b


def _dispatch(tmp_path, dataset, name, *extra, cwd=None):
    """`crossfeed dispatch` in a child (in ``cwd``); (process, endpoint or None if it exited first)."""
    ep = tmp_path / f"{name}.ep"
    ep.unlink(missing_ok=True)
    argv = ["dispatch", dataset, f"ipc://{tmp_path}/{name}.sock", "--batch-size", str(BATCH)]
    argv += [*HB, "--lease-size", "2", "--window", "4", "--endpoint-file", str(ep), *extra]
    code = f"import dispatch_helpers; dispatch_helpers.cli(*{argv!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    with open(tmp_path / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd or tmp_path
        )
    wait_until(lambda: (ep.exists() and ep.read_text()) or proc.poll() is not None, 60, "the dispatcher", [])
    return proc, (ep.read_text() if ep.exists() else None)


def _run_epoch(tmp_path, dataset, name, *extra, cwd=None):
    """One dispatcher, one server, one trainer over a whole epoch: the samples the trainer used."""
    d, address = _dispatch(tmp_path, dataset, name, "--linger", "1", *extra, cwd=cwd)
    assert address, (tmp_path / f"{name}.log").read_text()[-2000:]
    out = tmp_path / f"{name}-t.out"
    procs = [d]
    try:
        procs.append(start_server(tmp_path, dataset, address, f"{name}-s"))
        t = spawn("trainer", address, str(out), 0.0, log=tmp_path / f"{name}-t.log")
        procs.append(t)
        assert t.wait(120) == 0, (tmp_path / f"{name}-t.log").read_text()[-3000:]
        assert d.wait(30) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        stop(*procs)
    return used([out])


def test_two_datasets_in_one_directory_with_the_defaults_never_share_state(tmp_path, datasets):
    a, b = datasets
    here = tmp_path / "cwd"
    here.mkdir()
    assert _run_epoch(tmp_path, a, "da", cwd=here) == collections.Counter(range(N))
    assert _run_epoch(tmp_path, b, "db", cwd=here) == collections.Counter(range(N))  # b's own epoch, whole
    assert _run_epoch(tmp_path, b, "db2", cwd=here) == collections.Counter(range(N))  # a new run of the same
    assert list(here.iterdir()) == [], "the dispatcher wrote state beside its caller without --journal"


def test_a_journal_of_another_dataset_is_refused_naming_both(tmp_path, datasets):
    a, b = datasets
    journal = str(tmp_path / "shared.journal")
    d, _ = _dispatch(tmp_path, a, "d1", "--journal", journal)
    stop(d)  # journaled its plan (and nothing used): a run in progress
    d2, address = _dispatch(tmp_path, b, "d2", "--journal", journal)
    assert d2.wait(30) != 0 and address is None
    log = (tmp_path / "d2.log").read_text()
    assert "belongs to another stream" in log and "another dataset" in log and "--restart" in log


def test_a_finished_runs_journal_is_refused_and_restart_runs_it_again(tmp_path, datasets):
    a, _ = datasets
    journal = str(tmp_path / "j")
    assert _run_epoch(tmp_path, a, "first", "--journal", journal) == collections.Counter(range(N))
    d, address = _dispatch(tmp_path, a, "again", "--journal", journal)
    assert d.wait(30) != 0 and address is None
    assert "holds a finished run of this plan" in (tmp_path / "again.log").read_text()
    assert _run_epoch(tmp_path, a, "restarted", "--journal", journal, "--restart") == collections.Counter(range(N))


def test_a_server_of_another_dataset_is_refused(tmp_path, datasets):
    a, b = datasets
    d, address = _dispatch(tmp_path, a, "d")
    try:
        s = start_server(tmp_path, b, address, "wrong")
        log = tmp_path / "wrong.log"
        wait_until(lambda: "serve the same dataset, by content, that the dispatcher plans" in log.read_text(), 60, "")
    finally:
        stop(d, s)


def test_a_trainer_that_joins_a_finished_plan_is_told_why(tmp_path, datasets):
    a, _ = datasets
    d, address = _dispatch(tmp_path, a, "d", "--linger", "60")
    out1, out2 = tmp_path / "t1.out", tmp_path / "t2.out"
    procs = [d]
    try:
        procs.append(start_server(tmp_path, a, address, "s"))
        t1 = spawn("trainer", address, str(out1), 0.0, log=tmp_path / "t1.log")
        procs.append(t1)
        assert t1.wait(120) == 0, (tmp_path / "t1.log").read_text()[-3000:]
        t2 = spawn("trainer", address, str(out2), 0.0, log=tmp_path / "t2.log")
        procs.append(t2)
        assert t2.wait(60) != 0
        assert "received no batch" in (tmp_path / "t2.log").read_text()
    finally:
        stop(*procs)
    assert used([out1]) == collections.Counter(range(N))


def test_trainers_started_before_any_server_wait_then_get_every_batch_once(tmp_path, datasets):
    a, _ = datasets
    d, address = _dispatch(tmp_path, a, "d", "--linger", "1")
    outs = [tmp_path / "t0.out", tmp_path / "t1.out"]
    procs = [d]
    try:
        trainers = [spawn("trainer", address, str(o), 0.0, log=tmp_path / f"t{i}.log") for i, o in enumerate(outs)]
        procs += trainers
        wait_until(lambda: "joined" in (tmp_path / "d.log").read_text() or True, 5, "")
        import time

        time.sleep(2)  # the trainers are up and waiting, with no server
        assert all(t.poll() is None for t in trainers)
        procs.append(start_server(tmp_path, a, address, "late"))
        for i, t in enumerate(trainers):
            assert t.wait(120) == 0, (tmp_path / f"t{i}.log").read_text()[-3000:]
    finally:
        stop(*procs)
    assert used(outs) == collections.Counter(range(N))


def test_a_trainer_with_no_server_for_server_wait_gets_an_error_saying_so(tmp_path, datasets):
    import time

    import crossfeed
    from crossfeed.errors import CrossfeedError

    a, _ = datasets
    d, address = _dispatch(tmp_path, a, "d")
    try:
        start = time.monotonic()
        with crossfeed.connect(dispatcher=address, server_wait=2.0, heartbeat_interval=0.1) as c:
            with pytest.raises(CrossfeedError, match=r"no server joined the dispatcher .* in 2 s"):
                next(iter(c))
        assert time.monotonic() - start < 60
    finally:
        stop(d)
