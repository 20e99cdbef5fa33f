"""Per-sample weights of a dataset (`crossfeed.format.weights`): computed once from a feature of
its records (``crossfeed weights DATASET --feature w`` / ``--balance label``, `write_weights`),
written beside the manifest, and opened memory-mapped by a pipeline (`open_weights`).

Computing reads the feature of every record once, in record order, holding O(classes) in memory
(the class counts) and writing the prefix sums chunk by chunk; the ``.cw`` file is published by
rename before the set's description, so a reader sees the old set or the new one, whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shlex
from collections.abc import Iterator

import numpy as np

from crossfeed.errors import ConfigError, CrossfeedError, IndexFileError
from crossfeed.format import weights as fw
from crossfeed.io import roots
from crossfeed.read.sources.dataset import Dataset, open_dataset

CHUNK = 1 << 16  # records decoded per chunk of weights


def _local_root(ds: Dataset) -> str:
    if ds.index_storage.remote or ds.manifest_sha256 is None:
        raise ConfigError(
            f"{ds.path}: per-sample weights need a local dataset (the weights file is memory-mapped); "
            f"copy it to a local disk, or mount it"
        )
    return ds.index_storage.root


def _scalar_feature(ds: Dataset, feature: str, balance: bool):
    if feature not in ds.schema.names:
        raise ConfigError(f"{ds.path}: no feature {feature!r} to weigh by; the features are {ds.schema.names}")
    f = ds.schema[feature]
    try:
        numeric = np.dtype(f.dtype).kind in "iufb"
    except TypeError:  # 'string', 'bytes': no numpy dtype of that name
        numeric = False
    if any(d not in (1,) for d in f.shape) or (not balance and not numeric):
        raise ConfigError(
            f"{ds.path}: feature {feature!r} ({f.dtype}, shape {list(f.shape)}) is not one "
            f"{'value' if balance else 'number'} a record; weights are read from a scalar "
            f"{'feature (a class label)' if balance else 'numeric feature'}"
        )
    return f


def _values(split, feature: str) -> Iterator[list]:
    """The feature's value of every record of ``split``, in record order, ``CHUNK`` at a time."""
    out: list = []
    for s, n in enumerate(split.counts.tolist()):
        for k in range(n):
            v = np.asarray(split.decode(s, k, features=[feature], decode_images=False)[feature]).reshape(-1)
            out.append(v[0].item() if v.size == 1 else None)
            if len(out) >= CHUNK:
                yield out
                out = []
    if out:
        yield out


def _classes(split, feature: str) -> dict:
    counts: dict = {}
    for chunk in _values(split, feature):
        for v in chunk:
            if v is None:
                raise ConfigError(f"{split.dataset.path}: a record of split {split.name!r} has no {feature!r} value")
            if v != v:  # NaN: equal to no class, not even itself
                raise ConfigError(
                    f"{split.dataset.path}: a record of split {split.name!r} has a NaN {feature!r}; class balance "
                    f"needs labels that are classes (replace the NaNs, or weigh with --feature)"
                )
            counts[v] = counts.get(v, 0) + 1
    return counts


def write_weights(
    path,
    *,
    feature: str | None = None,
    balance: str | None = None,
    resolution: int = 1,
    name: str | None = None,
    splits: list[str] | None = None,
    allowed_roots=(),
) -> fw.WeightsMeta:
    """Write the weights set ``name`` of the dataset at ``path``: each record weighted by
    ``feature`` (a scalar number; floats quantised as ``round(value × resolution)``) or, with
    ``balance=FEATURE``, so that every class of that feature has the same total weight (the set
    ``crossfeed.balanced(FEATURE)`` names). ``name`` defaults to the feature's (``balance-F`` for
    balance). ``splits``: default every split; given, they are written into the set's
    description beside the splits it already has (from the same definition). Returns the set's description."""
    if (feature is None) == (balance is None):
        raise ConfigError("weights come from feature= (each record's value) or balance= (a class label), one of them")
    if type(resolution) is not int or not 1 <= resolution <= fw.MAX_RESOLUTION:
        raise ConfigError(f"resolution must be an integer in [1, {fw.MAX_RESOLUTION}], got {resolution!r}")
    ds = open_dataset(path, allowed_roots=allowed_roots)
    try:
        root = _local_root(ds)
        by = feature if balance is None else balance
        assert by is not None  # one of the two, checked above
        _scalar_feature(ds, by, balance is not None)
        name = fw.check_weights_name(name or (fw.balanced(by) if balance is not None else by))
        names = list(ds.splits) if splits is None else list(splits)
        os.makedirs(os.path.join(root, fw.DIR), exist_ok=True)
        roots.check_inside(os.path.join(root, fw.DIR), root, ds.allowed_roots)  # never written through a link out
        out = {}
        for split_name in names:
            split = ds[split_name]
            where = f"{ds.path}: split {split_name!r}, feature {by!r}"
            if balance is not None:
                per_class = fw.class_weights(_classes(split, by)) if len(split) else {}
                chunks = (np.array([per_class[v] for v in c], dtype=np.int64) for c in _values(split, by))
            else:
                chunks = (fw.quantise(np.array(c), resolution, where) for c in _values(split, by))
            out[split_name] = _write_file(root, name, split_name, len(split), fw.prefix_sums(chunks, where))
        if ds.manifest_sha256 is None:
            raise ConfigError(f"{ds.path}: weights are computed for a dataset with a manifest file; this one has none")
        meta = fw.WeightsMeta(
            name, "feature" if balance is None else "balance", by, resolution, ds.manifest_sha256, out
        )
        if splits is not None:  # the set's other splits, written before from the same definition, stay
            kept = _same_set(root, meta, ds.allowed_roots)
            meta = dataclasses.replace(meta, splits={**{k: v for k, v in kept.items() if k not in out}, **out})
        _replace(fw.meta_path(root, name), json.dumps(meta.to_json(), indent=1).encode())
        return meta
    finally:
        ds.close()


def _same_set(root: str, meta: fw.WeightsMeta, allowed) -> dict:
    """The splits of the set already written under ``meta.name`` when it is the same set (the same
    manifest, kind, feature and resolution), else ``{}`` (what is there is replaced whole)."""
    path = fw.meta_path(root, meta.name)
    try:
        roots.check_own_file(path, root, allowed, IndexFileError)
        with open(path, "rb") as f:
            old = fw.WeightsMeta.loads(f.read(fw.MAX_META_BYTES + 1), path)
    except (OSError, CrossfeedError):
        return {}
    same = (old.manifest_sha256, old.kind, old.feature, old.resolution) == (
        meta.manifest_sha256,
        meta.kind,
        meta.feature,
        meta.resolution,
    )
    return dict(old.splits) if same else {}


def _write_file(root: str, name: str, split: str, n: int, sums) -> fw.SplitWeights:
    file = fw.file_name(name, split)
    final = os.path.join(root, fw.DIR, file)
    tmp = os.path.join(root, fw.DIR, f".tmp-{secrets.token_hex(6)}-{file}")
    h, total = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for part in sums:
                if isinstance(part, int):
                    total = part
                    break
                data = part.tobytes()
                h.update(data)
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if total <= 0 and n:
            raise ConfigError(f"{root}: split {split!r}: every weight of set {name!r} is 0; nothing could be drawn")
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return fw.SplitWeights(file, n, total, h.hexdigest())


def _replace(path: str, data: bytes) -> None:
    tmp = os.path.join(os.path.dirname(path), f".tmp-{secrets.token_hex(6)}-{os.path.basename(path)}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _command(path, meta: fw.WeightsMeta) -> str:
    """The ``crossfeed weights`` command line that writes the set ``meta`` describes."""
    q = shlex.quote
    if meta.kind == "balance":
        cmd, default = f"crossfeed weights {q(str(path))} --balance {q(meta.feature)}", f"balance-{meta.feature}"
    else:
        cmd, default = f"crossfeed weights {q(str(path))} --feature {q(meta.feature)}", meta.feature
        if meta.resolution != 1:
            cmd += f" --resolution {meta.resolution}"
    return cmd if meta.name == default else f"{cmd} --name {q(meta.name)}"


def open_weights(ds: Dataset, name: str, split: str) -> fw.CumulativeWeights:
    """The weights set ``name`` of ``ds``'s ``split``, memory-mapped and checked: made from this
    very manifest (its SHA-256), for this split, of its record count. `ConfigError` /
    `IndexFileError` naming the set and how to write it otherwise."""
    root = _local_root(ds)
    meta_file = fw.meta_path(root, name)
    how = f"write it with `crossfeed weights {ds.path} --feature F` (or `--balance F` for crossfeed.balanced(F))"
    roots.check_own_file(meta_file, root, ds.allowed_roots, IndexFileError)  # no link out, no FIFO
    try:
        with open(meta_file, "rb") as f:
            text = f.read(fw.MAX_META_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{ds.path}: no weights set {name!r} ({meta_file}); {how}") from None
    meta = fw.WeightsMeta.loads(text, meta_file)
    if meta.name != name:
        raise IndexFileError(f"{meta_file}: names the set {meta.name!r}, not {name!r}; {how}")
    how = f"write it again with `{_command(ds.path, meta)}`"
    if meta.manifest_sha256 != ds.manifest_sha256:
        raise ConfigError(
            f"{meta_file}: the weights set {name!r} was computed for another version of the dataset (manifest "
            f"{meta.manifest_sha256[:12]}…, the dataset's is {str(ds.manifest_sha256)[:12]}…); {how}"
        )
    info = meta.splits.get(split)
    if info is None:
        raise ConfigError(
            f"{meta_file}: the weights set {name!r} has no split {split!r} (it has {sorted(meta.splits)}); {how}"
        )
    n = len(ds[split])
    if info.num_records != n:
        raise IndexFileError(f"{meta_file}: split {split!r} has {n} records, the set says {info.num_records}; {how}")
    if n and info.total <= 0:
        raise IndexFileError(f"{meta_file}: split {split!r}: every weight is 0; {how}")
    path = os.path.join(root, fw.DIR, info.file)
    roots.check_own_file(path, root, ds.allowed_roots, IndexFileError)
    return fw.CumulativeWeights.open(path, info, how)
