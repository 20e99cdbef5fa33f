"""``crossfeed verify`` for tar shards read in place (`crossfeed.format.tar`).

Tar has one check of its own: each 512-byte header's checksum. Member data has no checksum, so
what verify can say about it is the shard's sha256 against the manifest (any changed byte) and
that every sample still parses per the schema. Per shard: the file (regular, size, sha256), its
index (`crossfeed.format.index.checked_index`: count, tiling, index sha256), a fresh walk of every
header compared with the index entries, and every sample's members against the schema.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from crossfeed.errors import CorruptRecordError, IndexFileError, SchemaError
from crossfeed.format import index as idx
from crossfeed.format import tar
from crossfeed.format.manifest import ShardInfo
from crossfeed.format.schema import Schema
from crossfeed.io.files import file_sha256, map_file
from crossfeed.io.storage import Storage
from crossfeed.read.tools.problem import Problem

CANNOT = "tar has no payload checksums: member data is checked only by each shard's sha256"


def verify_tar_shard(
    storage: Storage,
    shard: ShardInfo,
    schema: Schema,
    *,
    progress: Callable[[int], None] | None = None,
    index_storage: Storage | None = None,
) -> list[Problem]:
    """The problems of one tar shard and its index (in ``index_storage``, default beside the
    tar; see the module docstring)."""
    path = storage.url(shard.file)
    ipath = (index_storage or storage).url(idx.index_path(shard.file))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return [Problem(path, None, "tar shard is missing; restore it, or re-index with `crossfeed index --force`")]
    if not stat.S_ISREG(st.st_mode):
        return [Problem(path, None, "not a regular file (a directory, FIFO or device); a shard is a plain file")]
    problems = []
    if st.st_size != shard.num_bytes:
        problems.append(Problem(path, None, f"file is {st.st_size} bytes, the manifest says {shard.num_bytes}"))
    if file_sha256(path) != shard.sha256:
        problems.append(Problem(path, None, "sha256 differs from the manifest: the file changed after it was indexed"))
    entries = None
    try:
        with open(ipath, "rb") as f:
            entries = idx.checked_index(f.read(), ipath, shard, gzip=lambda: False)
    except FileNotFoundError:
        problems.append(Problem(ipath, None, "index file is missing; rebuild it with `crossfeed index --force`"))
    except IndexFileError as e:
        problems.append(Problem(ipath, None, str(e).removeprefix(f"{ipath}: ")))
    with map_file(path) as buf:  # as indexed: the bytes as stored
        try:
            ranges = tar.sample_ranges(buf, path, lambda key, group: None)
        except CorruptRecordError as e:
            return [*problems, Problem(path, e.offset, e.reason)]
        except SchemaError as e:
            return [*problems, Problem(path, None, str(e).removeprefix(f"{path}: "))]
        if entries is not None and [tuple(r) for r in entries.tolist()] != ranges:
            problems.append(
                Problem(
                    ipath, None, "the index does not match the tar's samples; rebuild it with `crossfeed index --force`"
                )
            )
        for o, n in ranges:
            try:
                tar.decode_sample(buf, o, n, path, schema, decode_images=False)
            except CorruptRecordError as e:
                problems.append(Problem(path, e.offset, e.reason))
                break
            except SchemaError as e:
                problems.append(Problem(path, o, str(e).removeprefix(f"{path}: sample at byte offset {o}: ")))
                break
    if progress is not None:
        progress(st.st_size)
    return problems
