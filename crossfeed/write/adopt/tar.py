"""Adopting WebDataset tar shards in place (``crossfeed index DIR`` on a directory of ``.tar``
files, written by ``webdataset.ShardWriter``/``TarWriter``, GNU ``tar``, ``tarp`` or Python's
``tarfile``): every header's checksum is checked, members are grouped into samples by
webdataset's key rule, an ``.idx`` of each sample's byte range is written beside each tar (or
into the ``--index-dir``, the tars then read where they lie: a read-only directory or an fsspec
URL; `crossfeed.write.adopt.placement`) and the manifest (split ``format: "tar"``) last. The tars are
never modified.

The features are the samples' extensions (`crossfeed.format.tar.infer_feature`); every sample
must carry the same ones. ``features`` declarations (``jpg=bytes``, say) replace inference and
are checked against every sample.
"""

from __future__ import annotations

from collections.abc import Callable

from crossfeed.errors import ConfigError, SchemaError
from crossfeed.format import index as idx
from crossfeed.format import tar
from crossfeed.format.manifest import Manifest, ShardInfo, SplitInfo, check_name, write_manifest
from crossfeed.format.schema import Feature, Schema
from crossfeed.write.adopt.placement import Placement
from crossfeed.write.commit import dataset_lock


class _Inference:
    """The features the samples so far imply, checked sample by sample."""

    def __init__(self, declared: dict[str, Feature]):
        self.declared = declared
        self.exts: list[str] | None = None
        self.first = ""
        self.feats: dict[str, Feature] = {}

    def add(self, path: str, key: str, group: dict[str, tar.Member], buf) -> None:
        exts = sorted(group)
        first = min(group.values(), key=lambda m: m.start)
        where = f"{path}: member {first.name!r} at byte offset {first.start} (sample {key!r})"
        if self.exts is None:
            self.exts, self.first = exts, f"{path} sample {key!r}"
        elif exts != self.exts:
            raise SchemaError(
                f"{where} has members {exts}, the first sample ({self.first}) has {self.exts}; crossfeed needs "
                f"every sample to carry the same extensions"
            )
        view = memoryview(buf)
        for ext, m in group.items():
            data = view[m.data : m.data + m.size]
            try:
                if ext in self.declared:
                    tar.member_value(self.declared[ext], data, decode_images=False)
                    continue
                old = self.feats.get(ext)
                if old is not None and old.codec.image and not any(old.shape):
                    continue  # every dimension already varies: no need to read more headers
                f = tar.infer_feature(ext, data)
                self.feats[ext] = f = f if old is None else tar.widen(old, f)
                if not f.codec.image:  # the value must parse: an integer, UTF-8, an array
                    tar.member_value(f, data, decode_images=False)
            except SchemaError as e:
                raise SchemaError(f"{path}: member {m.name!r} at byte offset {m.start}: {e}") from e

    def schema(self) -> Schema:
        return Schema(self.declared.get(e) or self.feats[e] for e in self.exts or ())


def index_tar_shard(place: Placement, name: str, inference: _Inference) -> ShardInfo:
    """Index the tar ``name`` of ``place``'s data directory: write its ``.idx`` where the placement
    puts indexes and return its `ShardInfo`."""
    where = place.data_url(name)
    with place.open_bytes(name) as (buf, size, sha):
        ranges = tar.sample_ranges(buf, where, lambda key, group: inference.add(where, key, group, buf))
    index_sha = idx.write_index(place.index_path(name), ranges)
    return ShardInfo(name, len(ranges), size, sha, index_sha)


def index_tars(
    place: Placement,
    groups: dict[str, list[tuple[int, str]]],
    *,
    old: Manifest | None,
    declared: dict[str, Feature],
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Index the tar shards (``{split: [(number, file name)]}``) of ``place``'s data directory and
    write the manifest (with its ``data_root`` when the indexes sit apart from the tars)."""
    root = place.data
    inference = _Inference(declared)
    splits = {}
    for s, found in sorted(groups.items()):
        shards = []
        for _, n in sorted(found):
            check_name(n, root)
            info = index_tar_shard(place, n, inference)
            shards.append(info)
            if progress is not None:
                progress(info.num_bytes)
        splits[s] = SplitInfo(s, tuple(shards), format=tar.FORMAT)
    if inference.exts is None:
        raise ConfigError(f"{root}: the tars hold no samples, so there is no schema to infer; write some samples first")
    missing = sorted(set(declared) - set(inference.exts))
    if missing:
        raise SchemaError(f"{root}: declared features {missing} are not extensions of the samples ({inference.exts})")
    metadata = dict(old.metadata) if old else {}
    metadata.setdefault("source", "crossfeed index (webdataset tar)")
    manifest = Manifest(inference.schema(), splits, metadata, old.generation + 1 if old else 0, place.data_root)
    with dataset_lock(place.root):
        write_manifest(place.root, manifest)
    return manifest
