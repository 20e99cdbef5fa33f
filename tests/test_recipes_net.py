"""The recipes through the fleet, with real processes: a dispatcher leases no skipped step (and its
servers read no skipped sample), each epoch counted without them and each lockstep rank given the
same kept steps; `crossfeed serve --filter` delivers what the Loader with that filter gives, and
counts what it dropped; a per-sample-rng transform built by a dispatcher's servers (threads and
worker processes) gives the Loader's very bytes; a server with another skip list is refused, the
setting named."""

from __future__ import annotations

import collections
import re
import threading
import urllib.request

import numpy as np
import pytest
from dispatch_helpers import start_dispatcher, start_server
from net_helpers import FAST_HB, child, read_endpoint, stop, wait_until
from recipe_helpers import augment, keep_even, write

import crossfeed
from crossfeed.net import connect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # real dispatchers, servers and trainers

N, BATCH, SEED = 48, 4, 3
# global steps 2-3 (epoch 0) and 13-14 (epoch 1) at one rank; samples 5 and 30
SKIPS = "# a loss spike, and two bad samples\nsteps 2 4\nsteps 13 15\n5\n[0, 30]\n"
TRAINER = dict(FAST_HB, heartbeat_timeout=1.5, connect_timeout=20.0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return str(write(tmp_path_factory.mktemp("netrec") / "data", n=N, shards=3))


@pytest.fixture
def skips(tmp_path):
    path = tmp_path / "skips.txt"
    path.write_text(SKIPS)
    return str(path)


def _loader_batches(data, epochs: int, *, rank: int = 0, world_size: int = 1, **kw) -> list[tuple[int, list[int]]]:
    """(epoch, sample ids) of each batch the Loader yields."""
    out = []
    with crossfeed.Loader(
        data, batch_size=BATCH, seed=SEED, return_index=True, rank=rank, world_size=world_size, **kw
    ) as loader:
        for e in range(epochs):
            loader.set_epoch(e)
            out += [(e, b["__index__"].tolist()) for b in loader]
    return out


def _trainers(address: str, n: int) -> list[list[tuple[int, list[int]]]]:
    """``n`` trainers of a dispatcher in threads of this process: (epoch, sample ids) of each batch."""
    outs: list[list] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with connect(dispatcher=address, with_meta=True, **TRAINER) as c:
                outs[i] += [(m.epoch, m.sample_ids.tolist()) for m, _ in c]
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not errors, errors
    return outs


def test_a_dispatcher_leases_no_skipped_step_and_its_servers_read_no_skipped_sample(tmp_path, data, skips):
    d, address = start_dispatcher(
        tmp_path, data, "tcp://127.0.0.1:0", "--seed", str(SEED), "--epochs", "2", "--skip", skips
    )
    procs = [d]
    try:
        for name in ("s0", "s1"):
            procs.append(start_server(tmp_path, data, address, name, "--threads", "1", "--skip", skips))
        (got,) = _trainers(address, 1)
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    want = _loader_batches(data, 2, skip=skips)
    assert len(want) == 20  # 12 steps an epoch, 2 of each skipped
    assert sorted(got) == sorted(want), (tmp_path / "s0.log").read_text()[-3000:]
    ids = collections.Counter(i for _, b in got for i in b)
    assert ids[5] == ids[30] == 0 and set(ids.values()) == {1, 2}  # each once an epoch, unless its step was skipped
    assert "dispatching 10 of 12 batches in epoch 0 (skipped steps left out)" in (tmp_path / "d.log").read_text()


def test_lockstep_ranks_get_the_same_kept_steps_each_epoch(tmp_path, data):
    """--world-size 2: a global step is a step of both ranks; each trainer uses its epoch's kept steps."""
    path = tmp_path / "steps.txt"
    path.write_text("steps 2 4\nsteps 7 8\n")  # 6 steps an epoch a rank: epoch 0 keeps 4, epoch 1 keeps 5
    extra = ("--seed", str(SEED), "--epochs", "2", "--skip", str(path), "--world-size", "2")
    d, address = start_dispatcher(tmp_path, data, "tcp://127.0.0.1:0", *extra)
    procs = [d]
    try:
        procs.append(start_server(tmp_path, data, address, "s0", "--threads", "1", "--skip", str(path)))
        outs = _trainers(address, 2)
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    for out in outs:
        assert collections.Counter(e for e, _ in out) == {0: 4, 1: 5}
    want = [b for r in range(2) for b in _loader_batches(data, 2, rank=r, world_size=2, skip=str(path))]
    assert sorted(outs[0] + outs[1]) == sorted(want)


def test_serve_with_a_filter_delivers_the_loaders_filtered_batches_and_counts_the_dropped(tmp_path, data):
    ep = tmp_path / "ep"
    proc = child(
        "cli", "serve", data, "tcp://127.0.0.1:0", "--batch-size", str(BATCH), "--seed", str(SEED),
        "--epochs", "2", "--threads", "2", "--filter", "recipe_helpers:keep_even", "--max-filtered", "0.6",
        "--heartbeat-interval", "0.1", "--heartbeat-timeout", "2", "--endpoint-file", str(ep),
        "--metrics", "127.0.0.1:0", "--metrics-linger", "60",
        log=tmp_path / "serve.log",
    )  # fmt: skip
    try:
        with connect(read_endpoint(ep, procs=[proc]), with_meta=True, **FAST_HB) as client:
            got = [(m.epoch, m.sample_ids.tolist(), b["label"].tolist()) for m, b in client]
        log = tmp_path / "serve.log"
        url = wait_until(lambda: re.search(r"on (http://\S+)", log.read_text()), 20, "the metrics URL").group(1)
        metrics = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        stop(proc)
    want = []
    with crossfeed.Loader(data, batch_size=BATCH, seed=SEED, return_index=True, filter=keep_even) as loader:
        for e in range(2):
            loader.set_epoch(e)
            want += [(e, b["__index__"].tolist(), b["label"].tolist()) for b in loader]
    assert got == want and len(got) == 24  # every step, shorter: the odd samples dropped
    assert sorted(i for _, ids, _ in got for i in ids) == sorted(list(range(0, N, 2)) * 2)
    assert re.search(r'crossfeed_samples_filtered_total\{server="[^"]+"\} 48\.0', metrics), metrics[-2000:]


def test_a_dispatchers_servers_give_the_loaders_per_sample_random_bytes(tmp_path, data):
    """The rng transform runs on the servers (one with threads, one with worker processes): each
    sample of each epoch gets the bytes the Loader gives it (the epoch travels with the lease)."""
    d, address = start_dispatcher(tmp_path, data, "tcp://127.0.0.1:0", "--seed", str(SEED), "--epochs", "2")
    procs = [d]
    aug = ("--transform", "recipe_helpers:augment")
    try:
        procs.append(start_server(tmp_path, data, address, "s0", *aug, "--threads", "2"))
        procs.append(start_server(tmp_path, data, address, "s1", *aug, "--procs", "2"))
        got: dict[tuple[int, int], bytes] = {}
        with connect(dispatcher=address, with_meta=True, **TRAINER) as c:
            for m, b in c:
                for i, noise, shift in zip(m.sample_ids.tolist(), np.asarray(b["noise"]), np.asarray(b["shift"])):
                    assert (m.epoch, i) not in got
                    got[m.epoch, i] = noise.tobytes() + np.int64(shift).tobytes()
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    want = {}
    with crossfeed.Loader(data, batch_size=BATCH, seed=SEED, return_index=True, transform=augment) as loader:
        for e in range(2):
            loader.set_epoch(e)
            for b in loader:
                for i, noise, shift in zip(b["__index__"].tolist(), b["noise"], b["shift"]):
                    want[e, i] = noise.tobytes() + np.int64(shift).tobytes()
    assert len(want) == 2 * N and got == want
    assert want[0, 7] != want[1, 7]  # another epoch, other draws


def test_a_server_with_another_skip_list_is_refused_naming_it(tmp_path, data, skips):
    other = tmp_path / "other.txt"
    other.write_text("steps 2 5\n")
    d, address = start_dispatcher(tmp_path, data, "tcp://127.0.0.1:0", "--skip", skips)
    procs = [d]
    try:
        wrong = start_server(tmp_path, data, address, "wrong", "--skip", str(other))
        bare = start_server(tmp_path, data, address, "bare")  # no --skip at all
        procs += [wrong, bare]
        for name in ("wrong", "bare"):  # the server refuses the plan (it builds nothing)
            wait_until(lambda: "serve the same dataset" in (tmp_path / f"{name}.log").read_text(), 60, name, procs)
    finally:
        stop(*procs)
    log = (tmp_path / "wrong.log").read_text()
    assert "skip steps was [[2, 4], [13, 15]], is [[2, 5]]" in log and "skip samples was '2 sha256:" in log, log[-3000:]
    assert "with the same --skip" in log and "'leases': 0" in log
    assert "skip steps was [[2, 4], [13, 15]], is unset" in (tmp_path / "bare.log").read_text()
    with pytest.raises(AssertionError, match="child exited"):  # its journal is of the other skip list
        start_dispatcher(tmp_path, data, "tcp://127.0.0.1:0", "--skip", str(other), name="again")
    assert "belongs to another stream" in (tmp_path / "again.log").read_text()


def test_a_dispatcher_leases_a_weights_sets_draws_and_a_server_with_other_weights_is_refused(tmp_path):
    """--weights NAME on dispatch: the servers draw the Loader's weighted batches from their copy of
    the set; a server whose copy of the set has other bytes is refused, the setting named."""
    import shutil

    data, copy = str(tmp_path / "w"), str(tmp_path / "copy")
    samples = [{"x": np.full(3, i, np.int32), "label": i % 3, "w": i % 4} for i in range(N)]
    crossfeed.write_dataset(data, samples, num_shards=3).close()
    shutil.copytree(data, copy)
    crossfeed.write_weights(data, feature="w", name="w")
    crossfeed.write_weights(copy, balance="label", name="w")  # the same name, other weights
    extra = ("--seed", str(SEED), "--epochs", "2", "--weights", "w")
    d, address = start_dispatcher(tmp_path, data, "tcp://127.0.0.1:0", *extra)
    procs = [d]
    try:
        procs.append(start_server(tmp_path, data, address, "s0", "--threads", "1"))
        (got,) = _trainers(address, 1)
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
        d, address = start_dispatcher(tmp_path, data, "tcp://127.0.0.1:0", *extra, "--restart", name="d2")
        procs += [d, start_server(tmp_path, copy, address, "wrong")]
        log = tmp_path / "wrong.log"
        wait_until(lambda: "serve the same dataset" in log.read_text(), 60, "the refusal", procs)
    finally:
        stop(*procs)
    want = _loader_batches(data, 2, weights="w")
    assert sorted(got) == sorted(want) and len(want) == 24
    drawn = collections.Counter(i for _, b in got for i in b)
    assert len(drawn) == 36 and max(drawn.values()) > 1  # the 12 samples of weight 0 never, others again
    assert re.search(r"weights was 'w sha256:\w+', is 'w sha256:\w+'", log.read_text()), log.read_text()[-3000:]


def test_a_server_whose_filter_drops_past_max_filtered_fails_saying_so(tmp_path):
    from recipe_helpers import drop_most

    from crossfeed.errors import CrossfeedError
    from crossfeed.net import run
    from crossfeed.net.stream.server import ServerOptions
    from crossfeed.read.options import LoaderOptions

    data = write(tmp_path / "many", n=400, shards=4)
    opts = LoaderOptions.of(batch_size=8, max_filtered=0.5)
    server = ServerOptions((f"ipc://{tmp_path}/s",), epochs=1)
    with run.serving(str(data), opts, server, filter=drop_most) as s:
        with pytest.raises(CrossfeedError, match="its batch source failed"):
            with connect(s.endpoints, **FAST_HB) as client:
                for _ in client:
                    pass
        s.wait(30)
        assert s.filtered > 50 and s.status()["filtered"] == s.filtered
    with pytest.raises(CrossfeedError, match=r"drop_most dropped \d+ of \d+ samples .* more than max_filtered=0.5"):
        s.raise_if_failed()


def test_a_mixtures_skips_through_serve_and_dispatch_are_the_loaders(tmp_path):
    """A mixture spec file with a skip file of steps and (source, index) ids: `serve` streams the
    Loader's batches in order, a dispatcher's server leases them (each once)."""
    import json

    from crossfeed.read.sources.mixture_file import load_mixture_spec

    for name, n, offset in (("broad", 30, 0), ("hq", 10, 1000)):
        crossfeed.write_dataset(tmp_path / name, [{"id": offset + i} for i in range(n)], num_shards=2).close()
    spec = tmp_path / "mix.json"
    sources = [{"path": "broad", "weight": 3}, {"path": "hq", "weight": 1}]
    spec.write_text(json.dumps({"sources": sources, "samples_per_epoch": 40}))
    skips = tmp_path / "skips.txt"
    skips.write_text("steps 1 3\n1 4\n0 7\n")
    sources, n = load_mixture_spec(spec)
    opts = dict(batch_size=BATCH, seed=SEED, samples_per_epoch=n, skip=str(skips), return_index=True)
    with crossfeed.Loader(sources, **opts) as loader:
        batches = list(loader)
    want = [(0, b["__source__"].tolist(), b["id"].tolist()) for b in batches]
    drawn = {(int(s), int(i)) for b in batches for s, i in zip(b["__source__"], b["__index__"])}
    assert len(want) == 8 and (1, 4) not in drawn and (0, 7) not in drawn and (1, 3) in drawn
    ep = tmp_path / "ep"
    proc = child(
        "cli", "serve", str(spec), "tcp://127.0.0.1:0", "--batch-size", str(BATCH), "--epochs", "1",
        "--seed", str(SEED), "--skip", str(skips), "--threads", "1", "--heartbeat-interval", "0.1",
        "--heartbeat-timeout", "2", "--endpoint-file", str(ep), log=tmp_path / "serve.log",
    )  # fmt: skip
    try:
        with connect(read_endpoint(ep, procs=[proc]), with_meta=True, **FAST_HB) as client:
            served = [(m.epoch, b["__source__"].tolist(), b["id"].tolist()) for m, b in client]
        assert proc.wait(30) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        stop(proc)
    assert served == want
    extra = ("--seed", str(SEED), "--epochs", "1", "--skip", str(skips))
    d, address = start_dispatcher(tmp_path, str(spec), "tcp://127.0.0.1:0", *extra)
    procs = [d]
    try:
        procs.append(start_server(tmp_path, str(spec), address, "s0", "--threads", "1", "--skip", str(skips)))
        with connect(dispatcher=address, with_meta=True, **TRAINER) as c:
            leased = [(m.epoch, b["__source__"].tolist(), b["id"].tolist()) for m, b in c]
        assert d.wait(30) == 0, (tmp_path / "d.log").read_text()[-3000:]
    finally:
        stop(*procs)
    assert sorted(leased) == sorted(want)


def test_a_restarted_dispatcher_continues_a_plan_with_skips_exactly_once(tmp_path):
    """kill -9 of the dispatcher mid-epoch: the restarted one reads its journal (each epoch counted
    without its skipped steps) and the trainers end with the Loader's samples, each once."""
    import os
    import signal

    from dispatch_helpers import spawn, used, write_dataset

    data = str(tmp_path / "big")
    write_dataset(data, 480)  # 120 steps an epoch
    skips = tmp_path / "skips.txt"
    skips.write_text("steps 10 20\nsteps 100 130\nsteps 200 201\n3\n")  # epoch 0 keeps 100, epoch 1 keeps 99
    extra = ("--seed", str(SEED), "--epochs", "2", "--skip", str(skips))
    address = f"ipc://{tmp_path}/dispatch.sock"
    d, _ = start_dispatcher(tmp_path, data, address, *extra)
    procs = [d]
    try:
        procs += [start_server(tmp_path, data, address, f"s{i}", "--skip", str(skips)) for i in range(2)]
        outs = [tmp_path / f"t{i}.out" for i in range(2)]
        trainers = [spawn("trainer", address, str(o), 0.05, log=tmp_path / f"t{i}.log") for i, o in enumerate(outs)]
        procs += trainers
        wait_until(lambda: sum(used(outs).values()) >= 80, 60, "80 samples used", procs)
        os.kill(d.pid, signal.SIGKILL)
        d.wait(10)
        before = sum(used(outs).values())
        d2, _ = start_dispatcher(tmp_path, data, address, *extra, name="d2")
        procs.append(d2)
        for t in trainers:
            assert t.wait(120) == 0, [(tmp_path / f"t{i}.log").read_text()[-3000:] for i in range(2)]
        assert d2.wait(30) == 0, (tmp_path / "d2.log").read_text()[-3000:]
    finally:
        stop(*procs)
    want = _loader_batches(data, 2, skip=str(skips))
    assert len(want) == 199 and before < sum(len(b) for _, b in want)
    assert used(outs) == collections.Counter(i for _, b in want for i in b), "a sample lost, used twice or skipped"
    assert "continuing from journal" in (tmp_path / "d2.log").read_text()
