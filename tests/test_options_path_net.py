"""One options path, the network side: ``crossfeed serve`` and ``crossfeed dispatch`` parse their
flags into `ServerOptions` / `DispatcherOptions` whose defaults are the flags' defaults (never
restated), and hand them to the library (`crossfeed.net.run`), which serves and dispatches without
the CLI; `connect` takes one `ClientOptions`; every size option takes the size grammar."""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np
import pytest
from typer.testing import CliRunner

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.format.wire import WireLimits
from crossfeed.net import run
from crossfeed.net.connect import client_options, connect
from crossfeed.net.lease.dispatcher import DispatcherOptions
from crossfeed.net.protocol import Heartbeat
from crossfeed.net.stream.client import ClientOptions
from crossfeed.net.stream.server import ServerOptions
from crossfeed.read.options import LoaderOptions, ReadOptions
from crossfeed.write.options import WriteOptions

pytestmark = pytest.mark.timeout(120)
HB = Heartbeat(0.1, 2.0)
FAST = {"heartbeat_interval": 0.1, "heartbeat_timeout": 2.0, "connect_timeout": 15.0}


def _differ(a, b) -> list[str]:
    """The fields of two dataclasses of one class whose values differ, by name."""
    return [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]


@pytest.fixture
def captured(monkeypatch):
    """What each command hands the library: its LoaderOptions and its network options."""
    got = {}

    def serving(dataset, options, server, **kw):
        got["serve"] = (options, server, kw)
        raise SystemExit(0)

    def dispatch(dataset, options, dispatcher, **kw):
        got["dispatch"] = (options, dispatcher, kw)
        raise SystemExit(0)

    monkeypatch.setattr("crossfeed.net.run.serving", serving)
    monkeypatch.setattr("crossfeed.net.run.dispatch", dispatch)
    return got


def _cli(*args):
    from crossfeed.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_serve_and_dispatch_default_to_the_options_defaults_field_by_field(options_data, tmp_path, captured):
    s, d = f"ipc://{tmp_path}/s", f"ipc://{tmp_path}/d"
    _cli("serve", options_data, s)
    _cli("dispatch", options_data, d)
    _, server, kw = captured["serve"]
    assert _differ(server, ServerOptions((s,))) == [] and kw["dispatcher"] is None
    _, dispatcher, kw = captured["dispatch"]
    assert _differ(dispatcher, DispatcherOptions(d)) == []  # no journal unless --journal
    assert kw["world_size"] == 1


def test_serve_and_dispatch_flags_reach_their_options(options_data, tmp_path, captured):
    s, d = f"ipc://{tmp_path}/s", f"ipc://{tmp_path}/d"
    beat = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "5"]
    _cli("serve", options_data, s, "--epochs", "2", "--start-epoch", "1", "--mode", "broadcast", *beat,
         "--progress-timeout", "0", "--rank", "1", "--world-size", "2")  # fmt: skip
    _cli("dispatch", options_data, d, "--epochs", "3", "--lease-size", "4", "--window", "16", "--linger", "1",
         "--lease-timeout", "0", "--claim-timeout", "60", "--journal", tmp_path / "j", *beat, "--world-size", "2")  # fmt: skip
    options, server, _ = captured["serve"]
    want = ServerOptions(
        (s,), epochs=2, start_epoch=1, mode="broadcast", heartbeat=Heartbeat(0.5, 5.0), progress_timeout=None
    )
    assert _differ(server, want) == [] and (options.rank, options.world_size) == (1, 2)
    _, dispatcher, kw = captured["dispatch"]
    want = DispatcherOptions(d, tmp_path / "j", epochs=3, lease_size=4, window=16, linger=1.0,
                             heartbeat=Heartbeat(0.5, 5.0), lease_timeout=None, claim_timeout=60.0)  # fmt: skip
    assert _differ(dispatcher, want) == [] and kw["world_size"] == 2


def test_serve_and_dispatch_refuse_what_their_options_refuse(options_data, tmp_path, captured):
    for cmd, flags, says in [
        ("serve", ["--heartbeat-interval", "5", "--heartbeat-timeout", "1"], "heartbeat interval"),
        ("dispatch", ["--claim-timeout", "1"], "claim_timeout"),
        ("dispatch", ["--lease-timeout", "1"], "lease_timeout"),
    ]:
        r = _cli(cmd, options_data, f"ipc://{tmp_path}/x", *flags)
        assert r.exit_code == 2 and says in " ".join(r.output.split()), r.output
    assert captured == {}


def test_connect_takes_one_client_options_with_its_defaults(tmp_path):
    assert client_options(None, {}) == ClientOptions()
    assert client_options(None, {"heartbeat_interval": 0.5}).heartbeat == Heartbeat(0.5, Heartbeat().timeout)
    with connect(f"ipc://{tmp_path}/none", credit_bytes="1MB", credits=4) as c:
        assert c.options == ClientOptions(credit_bytes=1 << 20, credits=4)
    with connect(f"ipc://{tmp_path}/none", options=ClientOptions(credit_bytes="2MB")) as c:
        assert c.options.credit_bytes == 2 << 20
    with pytest.raises(ConfigError, match="credit_bytes 'lots'"):
        connect(f"ipc://{tmp_path}/none", credit_bytes="lots")
    with pytest.raises(ConfigError, match="unknown connect option.*'credit'"):
        connect(f"ipc://{tmp_path}/none", credit=4)
    with pytest.raises(ConfigError, match="not both"):
        connect(f"ipc://{tmp_path}/none", options=ClientOptions(), credits=4)


CONNECT_BAD = [
    ("credits", 0),
    ("credits", "4"),
    ("credit_bytes", "lots"),
    ("credit_bytes", -1),
    ("connect_timeout", 0),
    ("on_loss", "maybe"),
]


@pytest.mark.parametrize("field, value", CONNECT_BAD)
def test_connect_refuses_what_its_options_refuse_by_name(tmp_path, field, value):
    with pytest.raises(ConfigError) as a:
        ClientOptions(**{field: value})
    with pytest.raises(ConfigError) as b:
        connect(f"ipc://{tmp_path}/none", **{field: value})
    assert str(a.value) == str(b.value) and field in str(b.value)


SIZES = [
    (WriteOptions, "shard_size", {}),
    (ClientOptions, "credit_bytes", {}),
    (ServerOptions, "prefetch_bytes", {"addresses": ("ipc://x",)}),
    (ReadOptions, "cache_limit", {}),
    (WireLimits, "max_message_bytes", {}),
    (WireLimits, "max_header_bytes", {}),
]


@pytest.mark.parametrize("cls, field, more", SIZES, ids=[f"{c.__name__}.{f}" for c, f, _ in SIZES])
def test_every_size_option_takes_the_size_grammar(cls, field, more):
    for given, want in (("1.5KiB", 1536), ("2M", 2 << 20), (4096, 4096), ("4096", 4096)):
        assert getattr(cls(**more, **{field: given}), field) == want
    for bad in ("lots", "-1", [1]):
        with pytest.raises(ConfigError, match=field):
            cls(**more, **{field: bad})


# -- the library serves and dispatches without the CLI -------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("net") / "ds"
    crossfeed.write_dataset(path, [{"x": np.full(3, i, np.int64), "label": i} for i in range(40)], num_shards=3).close()
    return str(path)


def _thread(fn, *args, **kw):
    """``fn`` in a thread; its exception is kept (``.error``) for the test to raise."""
    t = threading.Thread(target=lambda: _keep(t, fn, *args, **kw), daemon=True)
    t.error = None
    t.start()
    return t


def _keep(t, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except BaseException as e:
        t.error = e


def test_serve_is_a_library_call(dataset, tmp_path):
    """`run.serving` streams the Loader's epochs (the same batches, with their indices);
    `run.serve` blocks until the stream ends or it is stopped."""
    options = LoaderOptions.of(batch_size=4, seed=3)
    got = collections.defaultdict(list)
    server_options = ServerOptions((f"ipc://{tmp_path}/s",), epochs=2, start_epoch=1, heartbeat=HB)
    with run.serving(dataset, options, server_options) as server:
        with connect(server.endpoints, with_meta=True, **FAST) as client:
            for meta, batch in client:
                got[meta.epoch].append(sorted(batch["label"].tolist()))
        assert server.wait(10)
    server.raise_if_failed()
    for epoch in (1, 2):
        with crossfeed.Loader(dataset, options, epoch=epoch) as loader:
            assert sorted(got[epoch]) == sorted(sorted(b["label"].tolist()) for b in loader)
    assert set(got) == {1, 2}

    stop, ready = threading.Event(), threading.Event()
    bound = []
    forever = ServerOptions((f"ipc://{tmp_path}/s2",), heartbeat=HB)
    t = _thread(
        run.serve, dataset, options, forever, stop=stop, on_ready=lambda s: (bound.extend(s.endpoints), ready.set())
    )
    assert ready.wait(30), t.error
    with connect(bound, **FAST) as client:
        first = [next(client) for _ in range(3)]
    assert all(len(b["label"]) == 4 for b in first)
    stop.set()
    t.join(30)
    assert not t.is_alive() and t.error is None


def test_dispatch_is_a_library_call(dataset, tmp_path):
    """`run.dispatch` owns the plan, `run.serve(dispatcher=...)` builds the leased batches, a
    trainer uses every sample once; `plan_dispatch` refuses what a dispatcher cannot lease."""
    options = LoaderOptions.of(batch_size=4, seed=5)
    ready, plans = threading.Event(), []
    stop = threading.Event()
    address = f"ipc://{tmp_path}/d"
    d_opts = DispatcherOptions(
        address, tmp_path / "journal", epochs=1, lease_size=2, window=4, linger=1.0, heartbeat=HB
    )
    d = _thread(
        run.dispatch, dataset, options, d_opts, stop=stop, on_ready=lambda _, plan: (plans.append(plan), ready.set())
    )
    assert ready.wait(30), d.error
    assert plans[0].batches == 10 and plans[0].plan == options.replace(rank=0, world_size=1).plan_fields()
    local = LoaderOptions.of(batch_size=1, num_threads=1)
    s = _thread(
        run.serve, dataset, local, ServerOptions((f"ipc://{tmp_path}/s",), heartbeat=HB), dispatcher=address, stop=stop
    )
    labels = collections.Counter()
    try:
        with connect(dispatcher=address, **FAST) as client:
            for batch in client:
                labels.update(batch["label"].tolist())
        d.join(30)
        assert not d.is_alive() and d.error is None
    finally:
        stop.set()
        s.join(30)
        d.join(30)
    assert labels == collections.Counter(range(40)) and s.error is None

    with pytest.raises(ConfigError, match="with a dispatcher"):
        with run.serving(dataset, local, ServerOptions((f"ipc://{tmp_path}/x",), epochs=1), dispatcher=address):
            pass
    with (
        pytest.raises(ConfigError, match="batch_by_tokens"),
        run.plan_dispatch(dataset, options.replace(batch_by_tokens=64), epochs=1),
    ):
        pass
