"""One options path: every front end without a framework — the Loader, the process-worker recipe,
a dispatcher's plan as a server rebuilds it, ``crossfeed bench``, ``serve`` and ``dispatch`` —
makes one `LoaderOptions` with the library's defaults and validation, and each option reaches the
stage that uses it. (The torch, TF, JAX and Grain adapters: test_options_path_torch.py / _tf.py /
_jax.py / _grain.py; the network options of serve, dispatch and connect: _net.py; the write side:
_write.py.)"""

from __future__ import annotations

import pytest
from options_helpers import (
    BAD,
    BY_TOKENS,
    CHANGED,
    IMAGES,
    PACKED,
    PACKED_FLAGS,
    expected,
    expected_tokens,
    keep,
    landed,
    landed_tokens,
    write_token_data,
)
from typer.testing import CliRunner

from crossfeed.cli.main import app
from crossfeed.cli.options import BATCH_SIZE
from crossfeed.errors import ConfigError
from crossfeed.read.executors.processes import WorkerRecipe
from crossfeed.read.loader import Loader
from crossfeed.read.options import LOCAL_FIELDS, LoaderOptions


def test_the_loader_puts_each_option_where_its_stage_reads_it(options_data):
    want = LoaderOptions.of(**CHANGED)
    with Loader(options_data, transform=keep, **CHANGED) as loader:
        assert loader.options == want
        assert landed(loader) == expected(want)
        batch = next(iter(loader))
    assert set(batch) == {"x", "__index__"} and len(batch["x"]) == 3


def test_the_image_options_reach_every_decoder_and_process(options_data, tmp_path, captured):
    """image_size/channels/resize: the decoder of a Loader holds them, a worker recipe and a
    dispatcher's plan carry them, and the commands' flags make the same options."""
    want = LoaderOptions.of(batch_size=3, **IMAGES)
    with Loader(options_data, transform=keep, batch_size=3, **IMAGES) as loader:
        assert landed(loader) == expected(want) and landed(loader)["image_fit"].size == (5, 4)
    back = WorkerRecipe.from_json(WorkerRecipe(options_data, want.replace(executor="process")).to_json())
    assert back.options.read.image_fit == want.read.image_fit
    local = LoaderOptions.of(batch_size=1)
    assert LoaderOptions.from_plan(want.plan_fields(), local).read.image_fit == want.read.image_fit
    _run("bench", options_data, "--batch-size", "3", "--image-size", "5x4", "--channels", "3", "--resize", "pad")
    assert captured["bench"] == want.replace(rank=0, world_size=1)


def test_defaults_are_the_options_defaults(options_data):
    with Loader(options_data, batch_size=3, transform=keep) as loader:
        assert loader.options == LoaderOptions.of(batch_size=3)
        assert landed(loader) == expected(LoaderOptions.of(batch_size=3))


@pytest.mark.parametrize("field, value", BAD)
def test_the_loader_and_the_options_refuse_the_same_values(options_data, field, value):
    with pytest.raises(ConfigError) as a:
        LoaderOptions.of(**{"batch_size": 3, **{field: value}})
    with pytest.raises(ConfigError) as b:
        Loader(options_data, **{"batch_size": 3, **{field: value}})
    assert str(a.value) == str(b.value)


def test_shuffle_true_and_false_are_the_global_and_no_shuffle():
    assert LoaderOptions.of(batch_size=2, shuffle=True).plan.shuffle.value == "global"
    assert LoaderOptions.of(batch_size=2, shuffle=False).plan.shuffle.value == "none"


def test_the_worker_recipe_carries_the_options_whole(options_data):
    options = LoaderOptions.of(**CHANGED, cache_limit="1.5GiB", executor="process", processes=3)
    back = WorkerRecipe.from_json(WorkerRecipe(options_data, options, "options_helpers:keep").to_json())
    assert back.options == options and back.options.read.cache_limit == 3 << 29


def test_a_dispatched_plan_carries_every_plan_field_and_the_server_keeps_its_own_work(tmp_path):
    planner = LoaderOptions.of(**CHANGED, cache_dir=str(tmp_path / "theirs"))
    local = LoaderOptions.of(batch_size=1, num_threads=5, prefetch=0, cache_dir=str(tmp_path / "mine"))
    shipped = planner.plan_fields()
    assert not set(shipped) & {*LOCAL_FIELDS, "rank", "worker", "num_workers"}
    built = LoaderOptions.from_plan(shipped, local)
    assert built.plan == planner.plan and built.features == planner.features and built.split == planner.split
    assert built.read.decode_images is False and built.read.on_error.value == "skip" and built.world_size == 2
    assert {k: getattr(built.read, k) for k in LOCAL_FIELDS} == {k: getattr(local.read, k) for k in LOCAL_FIELDS}
    for bad in ([1, 2], {"batch_size": 2, "num_threads": 9}, {"seed": 1}, {"batch_size": 0}):
        with pytest.raises(ConfigError):
            LoaderOptions.from_plan(bad, local)


FLAGS = [
    "--split", "val", "--batch-size", "3", "--shuffle", "block", "--seed", "7", "--drop-last",
    "--remainder", "drop", "--block-shards", "2", "--threads", "3", "--prefetch", "1",
    "--no-decode-images", "--on-error", "skip", "--max-skips", "5", "--read-timeout", "5",
    "--storage-option", "anon=true", "--storage-option", "client_kwargs.region_name=eu-west-1", "--log-stats",
]  # fmt: skip
CLI_CHANGED = {k: v for k, v in CHANGED.items() if k not in ("rank", "world_size", "features", "return_index")}


@pytest.fixture
def captured(monkeypatch):
    """What each command hands the library: the LoaderOptions (and the dispatcher's plan)."""
    got = {}

    def bench_loader(dataset, options, **kw):
        got["bench"] = options
        raise SystemExit(0)

    class Epochs:
        def __init__(self, dataset, options, *, transform=None, filter=None):
            got["serve"] = options
            raise SystemExit(0)

    class Dispatcher:
        def __init__(self, plan, batches, options, *, keys=None, counts=None, identity=None):
            got["dispatch"] = plan
            raise SystemExit(0)

    monkeypatch.setattr("crossfeed.read.tools.profile.bench_loader", bench_loader)
    monkeypatch.setattr("crossfeed.net.run.LoaderEpochs", Epochs)
    monkeypatch.setattr("crossfeed.net.run.LeaseDispatcher", Dispatcher)
    return got


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_every_command_builds_the_same_options_from_the_same_flags(options_data, tmp_path, captured):
    _run("bench", options_data, *FLAGS)
    _run("serve", options_data, "ipc://" + str(tmp_path / "s"), *FLAGS, "--rank", "1", "--world-size", "2")
    _run("dispatch", options_data, "ipc://" + str(tmp_path / "d"), *FLAGS, "--world-size", "2")
    want = LoaderOptions.of(**CLI_CHANGED, rank=0, world_size=1)
    assert captured["bench"] == want
    assert captured["serve"] == want.replace(rank=1, world_size=2)
    assert captured["dispatch"] == want.replace(world_size=2).plan_fields()


def test_every_command_defaults_to_the_library_defaults(options_data, tmp_path, captured):
    _run("bench", options_data)
    _run("serve", options_data, "ipc://" + str(tmp_path / "s"))
    _run("dispatch", options_data, "ipc://" + str(tmp_path / "d"))
    want = LoaderOptions.of(batch_size=BATCH_SIZE, rank=0, world_size=1)
    assert captured["bench"] == captured["serve"] == want
    assert captured["dispatch"] == want.plan_fields()


@pytest.mark.parametrize("field, value", [b for b in BAD if b[0] not in ("rank", "pack")])
def test_every_command_refuses_what_the_library_refuses(options_data, tmp_path, captured, field, value):
    flag = {"num_threads": "--threads", "storage_options": "--storage-option"}.get(
        field, "--" + field.replace("_", "-")
    )
    for cmd in (["bench", options_data], ["serve", options_data, "ipc://" + str(tmp_path / "s")]):
        r = _run(*cmd, flag, value)
        assert r.exit_code == 2, (cmd, r.output)
    assert captured == {}


def test_the_token_options_reach_the_plan_and_every_command(tmp_path, captured):
    """pack= / batch_by_tokens=: the Loader's plan and builder hold them, a worker recipe and a
    dispatcher's plan carry them, bench and serve make them from --pack-* / --batch-by-tokens,
    and dispatch leases packed batches (a count of its own each epoch) and refuses batch_by_tokens by name."""
    data = write_token_data(tmp_path / "tokens")
    for fields in (PACKED, BY_TOKENS):
        want = LoaderOptions.of(batch_size=2, **fields)
        with Loader(data, batch_size=2, **fields) as loader:
            assert loader.options == want and landed_tokens(loader) == expected_tokens(want)
        shipped = want.replace(executor="process")
        assert WorkerRecipe.from_json(WorkerRecipe(data, shipped).to_json()).options == shipped
        assert LoaderOptions.from_plan(want.plan_fields(), LoaderOptions.of(batch_size=1)).plan == want.plan
    for flags, fields in ((PACKED_FLAGS, PACKED), (["--batch-by-tokens", "64"], BY_TOKENS)):
        captured.clear()
        _run("bench", data, "--batch-size", "2", *flags)
        _run("serve", data, "ipc://" + str(tmp_path / "s"), "--batch-size", "2", *flags)
        want = LoaderOptions.of(batch_size=2, rank=0, world_size=1, **fields)
        assert captured["bench"] == captured["serve"] == want
        r = _run("dispatch", data, "ipc://" + str(tmp_path / "d"), "--batch-size", "2", *flags)
        if fields is PACKED:  # the dispatcher's plan carries the packing to every server
            assert captured["dispatch"] == want.plan_fields(), r.output
        else:
            assert r.exit_code == 2 and "crossfeed serve" in r.output and "dispatch" not in captured
    r = _run("bench", data, "--pack-features", "tokens")
    assert r.exit_code == 2 and "need --pack-length" in r.output
