"""The last step of a job: staged shards to their final names, then one manifest, written last.

Like `crossfeed.writer.commit_split`, but for every split of a job at once, so a run with
``--splits train=0.9,validation=0.1`` never leaves a manifest naming a new ``train`` beside an old
``validation``. While it runs the manifest is absent; a job killed at any point leaves either the
old dataset untouched (killed before this step) or no manifest at all, never a mix a reader accepts.
Temporary files are named ``.tmp-<token>-…``; `remove_temporaries` clears one job's (on failure) or
every other job's (stale ones, on success).
"""

from __future__ import annotations

import logging
import os
import shutil

from crossfeed import index as idx
from crossfeed.errors import ConfigError, SchemaError
from crossfeed.manifest import MANIFEST, Manifest, ShardInfo, SplitInfo, shard_name, write_manifest
from crossfeed.schema import Schema
from crossfeed.writer import StagedShard, read_manifest

log = logging.getLogger(__name__)
TMP_PREFIX = ".tmp-"


def commit_splits(root: str, staged: dict[str, list[StagedShard]], schema: Schema, *, compress: bool,
                  statistics: dict[str, dict] | None = None, metadata: dict | None = None) -> Manifest:
    """Add or replace the splits in ``staged`` (each list in shard order) at ``root``; other splits
    of an existing dataset are kept when their schema is the same."""
    if not staged or any(not v for v in staged.values()):
        raise ConfigError(f"{root}: nothing to commit ({ {k: len(v) for k, v in staged.items()} })")
    old = read_manifest(root)
    splits = dict(old.splits) if old else {}
    others = set(splits) - set(staged)
    if old and old.schema != schema and others:
        raise SchemaError(
            f"{root}: the dataset's splits {sorted(others)} have schema {old.schema.names} with other types than "
            f"this job's; write to another directory, or rewrite every split")
    manifest_path = os.path.join(root, MANIFEST)
    if os.path.exists(manifest_path):
        os.unlink(manifest_path)
    for name in staged:
        if name in splits:
            for sh in splits[name].shards:
                for p in (os.path.join(root, sh.file), idx.index_path(os.path.join(root, sh.file))):
                    if os.path.exists(p):
                        os.unlink(p)
    for name, shards in sorted(staged.items()):
        n = len(shards)
        infos = []
        for i, s in enumerate(shards):
            final = os.path.join(root, shard_name(name, i, n, compress=compress))
            os.replace(s.tmp_path, final)
            os.replace(idx.index_path(s.tmp_path), idx.index_path(final))
            infos.append(ShardInfo(os.path.basename(final), s.num_records, s.num_bytes, s.sha256))
        splits[name] = SplitInfo(name, tuple(infos), (statistics or {}).get(name, {}))
    meta = dict(old.metadata) if old else {}
    meta.update(metadata or {})
    manifest = Manifest(schema, splits, meta)
    write_manifest(root, manifest)
    return manifest


def remove_temporaries(root: str, *, token: str | None = None, keep: str | None = None) -> int:
    """Delete ``.tmp-*`` entries of ``root``: those of job ``token``, or all but ``keep``'s.
    Returns how many were removed."""
    if not os.path.isdir(root):
        return 0
    removed = 0
    for name in os.listdir(root):
        if not name.startswith(TMP_PREFIX):
            continue
        mine = name.startswith(f"{TMP_PREFIX}{token}") if token else True
        if not mine or (keep and name.startswith(f"{TMP_PREFIX}{keep}")):
            continue
        path = os.path.join(root, name)
        try:
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    if removed:
        log.info("%s: removed %d temporary files%s", root, removed, f" of job {token}" if token else "")
    return removed
