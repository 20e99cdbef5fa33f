"""The commit protocol: how staged shards become a dataset, atomically.

`commit_splits` is one journaled commit — shards under fresh names, then the manifest by one
rename, then the old files go — so readers see the old dataset or the new one, never a mix, and
a crash at any step is undone by the next writer (`remove_stale`). Writers of one directory
exclude each other (`writer_lock`, `dataset_lock`); `check_target` decides up front whether a
write may go there (``overwrite``, ``add_split``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator

from crossfeed.errors import ConfigError, CrossfeedError, ManifestError, SchemaError
from crossfeed.format import index as idx
from crossfeed.format.lengths import SUFFIX as LENGTHS_SUFFIX
from crossfeed.format.lengths import lengths_path
from crossfeed.format.manifest import (
    MANIFEST,
    VERSION_FILE,
    Manifest,
    ShardInfo,
    SplitInfo,
    check_name,
    fsync_dir,
    loads,
    shard_name,
    write_manifest,
)
from crossfeed.format.schema import Schema
from crossfeed.write.staging import TMP_PREFIX, StagedShard, crash_point

log = logging.getLogger(__name__)

_LOCK_TIMEOUT = 600.0


def read_manifest(root: str) -> Manifest | None:
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, "rb") as f:
            return loads(f.read(), path)
    except FileNotFoundError:
        return None


# ---- locks --------------------------------------------------------------------------------------


@contextlib.contextmanager
def writer_lock(root: str, token: str) -> Iterator[None]:
    """Holds ``.tmp-<token>.lock`` (flock) while a writer's temporary files exist, so that others
    know they are alive; a temporary file whose writer's lock is free is stale."""
    path = os.path.join(root, f"{TMP_PREFIX}{token}.lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break  # not removed by a cleaner between our open and our flock
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


@contextlib.contextmanager
def dataset_lock(root: str, timeout: float = _LOCK_TIMEOUT) -> Iterator[None]:
    """An exclusive flock on the dataset directory itself: one commit at a time (no extra file)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"{root}: another writer has been committing for {timeout:.0f} s; wait for it, or stop it"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _token_of(name: str) -> str:
    rest = name[len(TMP_PREFIX) :]
    return re.split(r"[-.]", rest, maxsplit=1)[0]


def _lock_is_free(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _remove_free_lock(path: str) -> None:
    """Unlink a lock file while holding it, so a writer that took it meanwhile is never robbed of
    it (`writer_lock` re-checks, after its flock, that its file is still the one at the path)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    except (BlockingIOError, FileNotFoundError):
        pass  # a writer holds it now, or it is gone already
    finally:
        os.close(fd)


def remove_entry(path: str) -> int:
    """Delete a file or a directory tree (a staging folder) that may already be gone; 1 if it was there."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return 0
    return 1


def remove_stale(root: str, *, keep: str | None = None) -> int:
    """Remove what dead writers left in ``root`` (call with `dataset_lock` held): temporary files
    whose writer's lock is free (or who had none), except those of token ``keep``; and the shards
    that a commit killed half-way renamed into place but no manifest names (listed in its
    journal). Returns how many entries were removed."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return 0
    current = read_manifest_or_none(root)
    removed = 0
    live = {
        _token_of(n)
        for n in names
        if n.startswith(TMP_PREFIX) and n.endswith(".lock") and not _lock_is_free(os.path.join(root, n))
    }
    for n in sorted(names):
        if not n.startswith(TMP_PREFIX) or n.endswith(".lock"):
            continue
        tok = _token_of(n)
        if tok in live or tok == keep:
            continue
        path = os.path.join(root, n)
        if n.endswith(_JOURNAL):
            if current is False:  # the manifest is unreadable: which orphans are safe to delete is unknown
                continue
            removed += _undo_journal(root, path, current.files if current else set())
        removed += remove_entry(path)
    for n in names:  # locks of dead writers last
        if n.startswith(TMP_PREFIX) and n.endswith(".lock") and _token_of(n) not in live and _token_of(n) != keep:
            _remove_free_lock(os.path.join(root, n))
    if removed:
        log.info("%s: removed %d files left by writers that died", root, removed)
    return removed


def read_manifest_or_none(root: str):
    """The manifest, None when there is none, False when it cannot be read."""
    try:
        return read_manifest(root)
    except (CrossfeedError, OSError):
        return False


_JOURNAL = ".commit"


def _undo_journal(root: str, path: str, keep: set[str]) -> int:
    """Delete the files a dead commit's journal lists (those it created and those it retired) that
    the current manifest does not name."""
    try:
        with open(path, "rb") as f:
            names = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return 0
    removed = 0
    for n in names if isinstance(names, list) else ():
        try:  # a shard name, or a shard name + ".idx"/".len": a plain name inside root either way
            check_name(_shard_of(n) if isinstance(n, str) else n, path)
        except ManifestError:
            continue
        if n in keep:
            continue
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(os.path.join(root, n))
            removed += 1
    return removed


def _shard_of(name: str) -> str:
    """The shard a file of the dataset belongs to (itself, or the shard of an index or lengths file)."""
    for suffix in (".idx", LENGTHS_SUFFIX):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def dataset_entries(root: str) -> list[str]:
    """What ``root`` holds besides writers' temporary files."""
    try:
        return sorted(n for n in os.listdir(root) if not n.startswith(TMP_PREFIX))
    except FileNotFoundError:
        return []


def check_target(
    root: str,
    *,
    overwrite: bool = False,
    add_split: bool = False,
    splits=(),
    clean: bool = False,
    append: bool = False,
) -> Manifest | None:
    """Whether a write may go to ``root``; returns the dataset there (None when there is none).

    Refuses a directory that holds a dataset (unless ``overwrite``, which replaces it whole, or
    ``add_split``, which adds splits it does not have yet) and a non-empty directory that holds
    none (unless ``overwrite``): never two conversions' splits side by side, never a dataset
    written among unrelated files. With ``clean`` what dead writers left is removed first (their
    orphaned shards are not "unrelated files"); a commit, holding the lock already, cleans itself.
    """
    if overwrite and add_split:
        raise ConfigError("give overwrite=True (replace the whole dataset) or add_split=True (add a split), not both")
    if append and (overwrite or add_split):
        raise ConfigError(
            "append=True adds shards to a dataset as a new version, keeping the old ones: not with overwrite= or add_split="
        )
    if clean and os.path.isdir(root):
        with dataset_lock(root):
            remove_stale(root)
    try:
        old = read_manifest(root)
    except ManifestError:
        if not overwrite:
            raise
        old = None
    if old is None:
        entries = dataset_entries(root)
        if entries and not overwrite:  # (append to no dataset: the first version, into an empty directory)
            raise ConfigError(
                f"{root}: the directory is not empty ({', '.join(entries[:3])}{', …' if len(entries) > 3 else ''}) and "
                f"holds no crossfeed dataset; write to a new directory, or pass overwrite=True (--overwrite)"
            )
        return None
    if append:
        if old.data_root is not None:
            raise ConfigError(
                f"{root}: the dataset indexes data that lies in {old.data_root} (crossfeed index --index-dir); "
                f"append to a self-contained dataset, or write the new data to a dataset of its own"
            )
        return old
    if add_split and old.data_root is not None:
        raise ConfigError(
            f"{root}: the dataset indexes data that lies in {old.data_root} (crossfeed index --index-dir); write new "
            f"splits to a dataset of their own, or overwrite=True to replace it with a self-contained one"
        )
    if add_split:
        clash = sorted(set(splits) & set(old.splits))
        if clash:
            raise ConfigError(
                f"{root}: the dataset already has split(s) {clash}; add_split adds new splits only. "
                f"Rewrite the whole dataset with overwrite=True (--overwrite)"
            )
    elif not overwrite:
        raise ConfigError(
            f"{root}: already holds a dataset (splits {sorted(old.splits)}); pass overwrite=True (--overwrite) to "
            f"replace all of it, add_split=True to add a new split, or write to a new directory"
        )
    return old


def commit_splits(
    root,
    staged: dict[str, list[StagedShard]],
    schema: Schema,
    *,
    statistics: dict[str, dict] | None = None,
    metadata: dict | None = None,
    overwrite: bool = False,
    add_split: bool = False,
    token: str | None = None,
    lengths: tuple[str, ...] = (),
    append: bool = False,
) -> Manifest:
    """Publish staged shards as the splits of the dataset at ``root``, in one atomic step.

    The steps, each durable before the next: a journal lists the final names; the shards move to
    names no version ever had (``.g<N>``, `next_generation`); the new
    manifest replaces the old one by one rename — the commit point; the old version's files are
    deleted; the journal goes. A process killed at any step leaves the old version or the new one,
    whole, and the next commit removes what it left. See `check_target` for ``overwrite`` and
    ``add_split``; ``token`` names the writer whose temporary files are kept while it commits.
    ``lengths``: the features whose per-record lengths every staged shard has a lengths file of
    (`crossfeed.format.lengths`), published with it as its index is.

    ``append``: the staged shards join the dataset's (a split it has grows, a new one is added) as
    its next version (`append_version`): the old manifest's bytes are kept as
    ``crossfeed.v<N>.json`` (written before the commit point) and pinned by the new manifest's
    ``versions``, and no old file is removed, so a reader of any version keeps reading it. The
    schema and the lengths features must be the dataset's (a difference names the feature).
    """
    root = os.fspath(root)
    lengths = tuple(lengths)
    if not staged or any(not v for v in staged.values()):
        raise ConfigError(f"{root}: nothing to commit ({ {k: len(v) for k, v in staged.items()} })")
    unpinned = [s.tmp_path for v in staged.values() for s in v if (s.lengths_sha256 is not None) != bool(lengths)]
    if unpinned:
        raise ConfigError(
            f"{root}: shard {unpinned[0]} has {'no ' if lengths else ''}lengths file, while the dataset lists "
            f"{list(lengths) or 'no'} lengths features; every shard of a dataset has one, or none does"
        )
    with dataset_lock(root):
        remove_stale(root, keep=token)
        old = check_target(root, overwrite=overwrite, add_split=add_split, splits=staged, append=append)
        if old and append:
            check_same_schema(root, old, schema, lengths)
        if old and add_split and old.schema != schema:
            raise SchemaError(
                f"{root}: the dataset's splits {sorted(old.splits)} have schema {old.schema.names} with other types "
                f"than the splits {sorted(staged)} being written; write to another directory, or overwrite it"
            )
        if old and add_split and old.lengths != lengths:
            raise SchemaError(
                f"{root}: the dataset's splits {sorted(old.splits)} have lengths files of {list(old.lengths)}, the splits "
                f"{sorted(staged)} being written of {list(lengths)}; write to another directory, or overwrite it"
            )
        taken = old.files if old else set()
        generation = next_generation(root, old)
        finals = {
            name: [
                shard_name(name, i, len(shards), compress=s.tmp_path.endswith(".gz"), generation=generation)
                for i, s in enumerate(shards)
            ]
            for name, shards in staged.items()
        }
        splits = dict(old.splits) if old and (add_split or append) else {}
        kept = {
            n for s in splits.values() for sh in s.shards for n in _files_of(sh.file, sh.lengths_sha256 is not None)
        }
        # The journal names every file this commit creates or retires: whatever version a crash
        # leaves, the next commit deletes those of them that its manifest does not name.
        journal = os.path.join(root, f"{TMP_PREFIX}{token or secrets.token_hex(6)}-{secrets.token_hex(4)}{_JOURNAL}")
        _write_durably(
            journal,
            json.dumps(
                sorted(
                    {x for names in finals.values() for n in names for x in _files_of(n, bool(lengths))}
                    | (taken - kept)
                )
            ),
        )
        fsync_dir(root)
        crash_point("journal written")
        for name, shards in sorted(staged.items()):
            infos = []
            for s, final in zip(shards, finals[name]):
                os.replace(s.tmp_path, os.path.join(root, final))
                crash_point("shard renamed")
                os.replace(idx.index_path(s.tmp_path), idx.index_path(os.path.join(root, final)))
                crash_point("index renamed")
                if s.lengths_sha256 is not None:
                    os.replace(lengths_path(s.tmp_path), lengths_path(os.path.join(root, final)))
                    crash_point("lengths renamed")
                infos.append(
                    ShardInfo(
                        final, s.num_records, s.num_bytes, s.sha256, s.index_sha256, None, s.lengths_sha256, s.crc32c
                    )
                )
            stats = (statistics or {}).get(name, {})
            if name in splits:  # appended to a split the dataset has: its shards first, then these
                prev = splits[name]
                splits[name] = SplitInfo(
                    name, prev.shards + tuple(infos), merge_statistics(prev.statistics, stats), prev.format
                )
            else:
                splits[name] = SplitInfo(name, tuple(infos), stats)
        fsync_dir(root)
        meta = dict(old.metadata) if old and (add_split or append) else {}
        meta.update(metadata or {})
        version = 1
        versions: tuple[tuple[int, str], ...] = ()
        if old and (append or (add_split and old.versions)):  # a new version; the old one stays readable
            version, versions = old.dataset_version + 1, (*old.versions, keep_version(root, old))
            crash_point("version kept")
        manifest = Manifest(
            schema, splits, meta, generation, lengths=lengths, dataset_version=version, versions=versions
        )
        write_manifest(root, manifest, before_rename=lambda: crash_point("manifest staged"))
        crash_point("manifest renamed")  # the commit point: from here on readers see the new version
        for n in sorted(taken - manifest.files):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, n))  # a plain name (the manifest was checked): inside root
            crash_point("old file removed")
        fsync_dir(root)
        os.unlink(journal)
        crash_point("journal removed")
    return manifest


def check_same_schema(root: str, old: Manifest, schema: Schema, lengths: tuple[str, ...]) -> None:
    """Refuse (`SchemaError` naming the feature) shards to append whose schema or lengths
    features are not the dataset's."""
    if old.schema == schema and tuple(old.lengths) == tuple(lengths):
        return
    was = {f.name: f for f in old.schema}
    now = {f.name: f for f in schema}
    fix = (
        "write the new data with the dataset's schema (schema=crossfeed.open_dataset(path).schema), "
        "or as a dataset of its own"
    )
    for name in [*was, *(n for n in now if n not in was)]:
        a, b = was.get(name), now.get(name)
        if a != b:

            def spec(f):
                if f is None:
                    return "absent"
                return f"{f.dtype}{list(f.shape)} ({f.encoding.value})"

            raise SchemaError(
                f"{root}: cannot append: feature {name!r} is {spec(a)} in the dataset, {spec(b)} in the shards "
                f"appended; {fix}"
            )
    if list(old.schema.names) != list(schema.names):
        raise SchemaError(
            f"{root}: cannot append: the features are in another order ({list(schema.names)}, the dataset has "
            f"{list(old.schema.names)}); {fix}"
        )
    raise SchemaError(
        f"{root}: cannot append: the dataset keeps lengths files of {list(old.lengths)}, the shards appended of "
        f"{list(lengths)}; write them with lengths={tuple(old.lengths)}"
    )


def keep_version(root: str, old: Manifest) -> tuple[int, str]:
    """Keep the current manifest's bytes as ``crossfeed.v<N>.json`` (N its ``dataset_version``),
    durably, before a new version replaces it; ``(N, its sha256)``. A copy left by a commit that
    died is the same bytes (kept); other bytes under the name are refused."""
    with open(os.path.join(root, MANIFEST), "rb") as f:
        data = f.read()
    if loads(data, os.path.join(root, MANIFEST)) != old:
        raise ConfigError(f"{root}: the manifest changed while appending; try again")
    path = os.path.join(root, VERSION_FILE.format(old.dataset_version))
    if os.path.exists(path):
        with open(path, "rb") as f:
            if f.read() != data:
                raise ConfigError(
                    f"{path}: holds another manifest than version {old.dataset_version} of the dataset; move it away"
                )
    else:
        tmp = os.path.join(root, f"{TMP_PREFIX}{secrets.token_hex(6)}-version")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(root)
    return old.dataset_version, hashlib.sha256(data).hexdigest()


def merge_statistics(a: dict, b: dict) -> dict:
    """A split's statistics (``{feature: FeatureStats.to_json()}``) and those of the shards
    appended to it, as one: counts and totals added, min/max combined, means weighted by count,
    shapes and length histograms added."""
    out = {}
    for k in [*a, *(k for k in b if k not in a)]:
        x, y = a.get(k), b.get(k)
        if not isinstance(x, dict) or not isinstance(y, dict):
            out[k] = x if isinstance(x, dict) else y
            continue
        out[k] = _merge_stat(x, y)
    return out


def _merge_stat(x: dict, y: dict) -> dict:
    d: dict = {"count": x.get("count", 0) + y.get("count", 0)}
    for key, pick in (("min", min), ("max", max)):
        vals = [v[key] for v in (x, y) if v.get(key) is not None]
        if vals:
            d[key] = pick(vals)
    means = [(v["mean"], v.get("count", 0)) for v in (x, y) if v.get("mean") is not None]
    if means:
        n = sum(c for _, c in means)
        d["mean"] = sum(m * c for m, c in means) / n if n else means[0][0]
    shapes = dict(x.get("shapes") or {})
    for s, n in (y.get("shapes") or {}).items():
        shapes[s] = shapes.get(s, 0) + n
    if shapes:
        d["shapes"] = shapes
    lx, ly = x.get("lengths"), y.get("lengths")
    if isinstance(lx, dict) and isinstance(ly, dict):
        ln = {"count": lx.get("count", 0) + ly.get("count", 0), "total": lx.get("total", 0) + ly.get("total", 0)}
        for key, pick in (("min", min), ("max", max)):
            vals = [v[key] for v in (lx, ly) if v.get(key) is not None]
            if vals:
                ln[key] = pick(vals)
        if ln["count"]:
            ln["mean"] = ln["total"] / ln["count"]
        hist = dict(lx.get("histogram") or {})
        for b, n in (ly.get("histogram") or {}).items():
            hist[b] = hist.get(b, 0) + n
        ln["histogram"] = hist
        d["lengths"] = ln
    elif isinstance(lx or ly, dict):
        d["lengths"] = lx or ly
    return d


def _files_of(shard: str, lengths: bool) -> tuple[str, ...]:
    """A TFRecord shard's files: itself, its index and, where it has one, its lengths file."""
    return (shard, shard + ".idx") + ((lengths_path(shard),) if lengths else ())


# a shard name `shard_name` gives (any split, any generation), or its index or lengths file's
_GENERATION = re.compile(r".+-\d{5,}-of-\d{5,}(?:\.g(\d{1,18}))?\.tfrecord(?:\.gz)?(?:\.idx|\.len)?")


def next_generation(root: str, old: Manifest | None) -> int:
    """The generation of the next commit into ``root``: above the current manifest's and above
    every generation whose shard names the directory holds (files of a lost or unreadable
    manifest included). A commit names its shards with it (``.g<N>``, plain only for the first),
    so no commit ever reuses a name an earlier version had: a reader of an old version finds its
    files, or none, never another version's bytes under its names."""
    seen = [int(m.group(1) or 0) for n in dataset_entries(root) if (m := _GENERATION.fullmatch(n)) is not None]
    return max(old.generation + 1 if old else 0, max(seen) + 1 if seen else 0)


def _write_durably(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit_split(
    root,
    split: str,
    staged: list[StagedShard],
    schema: Schema,
    *,
    statistics: dict | None = None,
    metadata: dict | None = None,
    overwrite: bool = False,
    add_split: bool = False,
    token: str | None = None,
    lengths: tuple[str, ...] = (),
    append: bool = False,
) -> Manifest:
    """`commit_splits` for one split."""
    return commit_splits(
        root,
        {split: staged},
        schema,
        statistics={split: statistics or {}},
        metadata=metadata,
        overwrite=overwrite,
        add_split=add_split,
        token=token,
        lengths=lengths,
        append=append,
    )
