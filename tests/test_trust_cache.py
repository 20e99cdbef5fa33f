"""The shard cache removes only what it wrote and never follows a link (issue 22, item 1), and a
cache smaller than the working set never pulls an entry from under a reader (item 8): planted
symlinks, a cache_dir pointed at someone's folder, and several processes sharing a tiny cache,
against a real HTTP server."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import crossfeed
from crossfeed.io.cache import MARKER, ShardCache

pytest.importorskip("aiohttp")

import test_cache  # noqa: E402
from http_helpers import serving  # noqa: E402

pytestmark = pytest.mark.slow  # remote fault matrix

served = test_cache.served  # the fixture: a 6-shard dataset over HTTP


def _victim(tmp_path):
    """A folder of someone's work: what the cache must never touch."""
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    (work / "src" / "main.py").write_text("print('mine')")
    return work


def _intact(work) -> bool:
    return (work / "notes.txt").read_text() == "mine" and (work / "src" / "main.py").read_text() == "print('mine')"


def _fill(url, cache_dir) -> None:
    with crossfeed.Loader(url, batch_size=600, shuffle="none", cache_dir=cache_dir) as ld:
        assert sum(len(b["id"]) for b in ld) == 600


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crossfeed.cli.main", *args], capture_output=True, text=True, timeout=120
    )


def test_a_link_planted_at_the_top_of_a_shared_cache_refuses_it_and_deletes_nothing(served, tmp_path):
    url, _, _ = served
    work, cache_dir = _victim(tmp_path), tmp_path / "c"
    _fill(url, cache_dir)
    os.symlink(work, cache_dir / "zz")  # planted by another user of a shared cache dir
    with pytest.raises(crossfeed.ConfigError, match=r"not a crossfeed cache.*zz"):
        with crossfeed.Loader(url, batch_size=50, cache_dir=cache_dir, cache_limit=1) as ld:
            list(ld)
    out = _cli("cache", "clear", "--dir", str(cache_dir))
    assert out.returncode == 2 and "not a crossfeed cache" in out.stderr and "Traceback" not in out.stderr
    assert _intact(work)


def test_a_link_planted_in_a_cache_in_use_is_skipped_not_followed(served, tmp_path):
    """A cache already open (a running Loader's) when a link appears: an entry folder named
    like one of its own, a lock file; `clear` and eviction walk past them."""
    url, _, _ = served
    work, cache_dir = _victim(tmp_path), tmp_path / "c"
    _fill(url, cache_dir)
    cache = ShardCache(cache_dir, limit=1)
    free = next(f"{i:02x}" for i in range(256) if not (cache_dir / f"{i:02x}").exists())
    os.symlink(work, cache_dir / free)
    (work / (free + "a" * 62)).write_text("named like an entry")
    os.symlink(work / "notes.txt", cache_dir / ".locks" / (free + "a" * 62 + ".lock"))
    assert len(cache.entries()) == 6
    cache.prune(1)
    assert cache.entries() == [] and cache.clear() == 0
    assert _intact(work) and (work / (free + "a" * 62)).exists()


def test_cache_dir_pointed_at_a_folder_of_files_is_refused(served, tmp_path):
    url, _, _ = served
    work = _victim(tmp_path)
    with pytest.raises(crossfeed.ConfigError, match=r"not a crossfeed cache.*notes.txt"):
        with crossfeed.Loader(url, batch_size=50, shuffle="block", cache_dir=work, cache_limit=1) as ld:
            list(ld)
    for cmd in (["clear"], ["prune", "0"]):
        out = _cli("cache", *cmd, "--dir", str(work))
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and "not a crossfeed cache" in out.stderr
    assert _intact(work) and not (work / MARKER).exists()


def test_only_the_caches_own_names_are_removed(served, tmp_path):
    """Files in an entry folder that are not entries (wrong name, a link named like an entry, a
    FIFO) survive `clear`; the entries and dead temporary files go."""
    url, _, _ = served
    work, cache_dir = _victim(tmp_path), tmp_path / "c"
    _fill(url, cache_dir)
    folder = next(p for p in cache_dir.iterdir() if len(p.name) == 2)
    (folder / "keep.txt").write_text("not an entry")
    os.symlink(work / "notes.txt", folder / (folder.name + "f" * 62))  # named like an entry: a link
    os.mkfifo(folder / (folder.name + "e" * 62))
    (folder / ".tmp-999999999-0123abcd").write_bytes(b"x")  # a dead download's leftover
    assert ShardCache(cache_dir).clear() > 0
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted(["keep.txt", folder.name + "f" * 62, folder.name + "e" * 62])
    assert _intact(work)


def test_a_link_or_fifo_named_like_an_entry_is_replaced_not_read(served, tmp_path):
    url, root, _ = served
    cache_dir = tmp_path / "c"
    _fill(url, cache_dir)
    entries = ShardCache(cache_dir).entries()
    os.unlink(entries[0].path)
    os.mkfifo(entries[0].path)  # would block a plain open() forever
    os.unlink(entries[1].path)
    os.symlink(root / sorted(os.listdir(root))[0], entries[1].path)
    with crossfeed.Loader(root, batch_size=600, shuffle="none") as local:
        want = sorted(int(i) for b in local for i in b["id"])
    with crossfeed.Loader(url, batch_size=600, shuffle="none", cache_dir=cache_dir) as ld:
        assert sorted(int(i) for b in ld for i in b["id"]) == want
    for e in entries[:2]:
        assert os.path.isfile(e.path) and not os.path.islink(e.path)


_SHARE_SMALL = """
import sys, collections, crossfeed
url, cache_dir, shuffle, shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
kw = dict(executor="process", processes=2) if sys.argv[5] == "process" else dict(num_threads=4)
for k in (1, 2, 3):  # a cache of k shards: smaller than what the readers hold at once
    seen = collections.Counter()
    with crossfeed.Loader(url, batch_size=16, shuffle=shuffle, block_shards=1, seed=1,
                          cache_dir=f"{cache_dir}/{k}", cache_limit=k * shard, **kw) as ld:
        for epoch in range(2):
            for b in ld:
                seen.update(int(i) for i in b["id"])
    print(k, len(seen), sorted(set(seen.values())))
"""


@pytest.mark.parametrize("shuffle", ["none", "block", "global"])
def test_a_cache_of_one_to_three_shards_shared_by_processes_never_loses_a_mapped_entry(served, tmp_path, shuffle):
    """Three processes (two with reader threads, one with worker processes) share caches of
    1, 2 and 3 shards: each reads every sample of both epochs, none sees an entry vanish."""
    url, root, handler = served
    handler.latency = 0.0
    shard = max(os.path.getsize(root / f) for f in os.listdir(root) if f.endswith(".tfrecord"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SHARE_SMALL, url, str(tmp_path / "c"), shuffle, str(shard), executor],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for executor in ("thread", "thread", "process")
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert out.splitlines() == [f"{k} 600 [2]" for k in (1, 2, 3)], (out, err[-2000:])


def test_an_entry_removed_after_it_was_opened_stays_readable(served, tmp_path):
    """What another process's eviction or `crossfeed cache clear` does to an entry in use."""
    url, root, _ = served
    ds = crossfeed.open_dataset(url)
    info = ds["train"].shards[0]
    cache = ShardCache(tmp_path / "c")
    path, stream = cache.open(ds.storage, info.file, info.sha256, info.num_bytes)
    assert ShardCache(tmp_path / "c").clear() == info.num_bytes and not os.path.exists(path)
    assert bytes(stream) == (root / info.file).read_bytes()
    cache.release(path)


# ---- issue 35, item 11: a bounded cache stays within one shard of its limit ------------------


def _cache_files(cache_dir) -> dict[tuple[int, int], tuple[int, int]]:
    """Every file under the cache directory (entries, downloads in progress, locks), its marker
    aside: ``{(device, inode): (fd, size)}``, each opened (read-only) and held open, so that its
    inode number cannot go to a file created after it while it is held: a file of one listing
    found again in the next is the same file, under the same or a new name."""
    files = {}
    for d, _, names in os.walk(cache_dir):
        for f in names:
            if f != MARKER:
                with contextlib.suppress(OSError):  # gone (or renamed) since it was listed
                    fd = os.open(os.path.join(d, f), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) in files:  # a download renamed while listed: listed twice
                        os.close(fd)
                    else:
                        files[st.st_dev, st.st_ino] = (fd, st.st_size)
    return files


def _sample_cache_bytes(cache_dir, stop: threading.Event) -> int:
    """The most bytes the cache directory held at once, sampled until ``stop``: the files found by
    two listings in a row (the first one's held open until the second is done), each at the
    smaller of its two sizes — all of them were in the directory together between the two
    listings, so the sum is bytes it held at one moment. (The sum over one listing alone is not:
    a listing takes time — milliseconds on a loaded machine — so it can count an entry, then,
    in a folder listed later, a download that started after that entry was evicted.)"""
    peak, before = 0, {}
    try:
        while not stop.is_set():
            now = _cache_files(cache_dir)
            peak = max(peak, sum(min(n, before[k][1]) for k, (_, n) in now.items() if k in before))
            for fd, _ in before.values():
                os.close(fd)
            before = now
    finally:
        for fd, _ in before.values():
            os.close(fd)
    return peak


@pytest.mark.parametrize(
    "kw",
    [
        dict(block_shards=4),  # the default: a window of 8 shards against a cache of 3
        dict(block_shards=4, num_threads=4),
        dict(block_shards=2, num_threads=1, prefetch=0),
        dict(block_shards=1),
    ],
)
def test_a_block_shuffle_keeps_the_cache_within_one_shard_of_its_limit(tmp_path, caplog, kw):
    """10 shards of ~0.2 MB over HTTP, a cache of 3: the directory, sampled all through two epochs
    (downloads in progress included), never holds more than the limit plus one shard; every
    sample comes once per epoch; no download had to give up waiting for room."""
    root = tmp_path / "ds"
    rng = np.random.default_rng(0)
    crossfeed.write_dataset(
        root, [{"x": rng.integers(0, 255, 2000, dtype=np.uint8), "id": i} for i in range(1000)], num_shards=10
    ).close()
    shard = max(os.path.getsize(root / f) for f in os.listdir(root) if f.endswith(".tfrecord"))
    limit, cache_dir = 3 * shard, tmp_path / "c"
    peak, stop = [0], threading.Event()

    def sample():
        peak[0] = _sample_cache_bytes(cache_dir, stop)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with caplog.at_level(logging.WARNING, "crossfeed"), serving(root) as url:
            with crossfeed.Loader(
                url, batch_size=20, shuffle="block", seed=1, cache_dir=cache_dir, cache_limit=limit, **kw
            ) as ld:
                for epoch in range(2):
                    ld.set_epoch(epoch)
                    assert sorted(int(i) for b in ld for i in b["id"]) == list(range(1000))
    finally:
        stop.set()
        sampler.join()
    assert 0 < peak[0] <= limit + shard, f"peak {peak[0]} bytes, limit {limit}, shards of {shard}"
    assert "no room under cache_limit" not in caplog.text
    if kw["block_shards"] > 3:  # the cache holds fewer shards than a block reads at once: said once
        assert caplog.text.count("cache_limit holds 3 of its shards, a block shuffle reads 4") == 1
