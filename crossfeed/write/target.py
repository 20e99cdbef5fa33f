"""Where a write goes: a local directory, or any fsspec URL the read side reads (``s3://``,
``gs://``, an S3-compatible endpoint through ``storage_options``, ``memory://``).

`write_target` is how every writer (`crossfeed.write.writer.write_samples`, the Beam job,
``crossfeed index --index-dir``) reaches its output. A local directory is written in place, with
the journaled commit of `crossfeed.write.commit`. A URL is written in two steps, because an
object store has no rename and no locks:

1. the write runs into a local staging directory (under ``$TMPDIR``) that holds a copy of the
   URL's current manifest, so the commit there decides what it would on disk: refusals
   (``overwrite``, ``add_split``), the next generation, the new manifest;
2. `publish` uploads the new files under their final names — names no committed version had (the
   generation, ``.g<N>``) — then PUTs the manifest last: one object, so one atomic step on S3 and
   GCS (readers see the old manifest or the new one, never a mix) — then deletes the old version's
   files and what crashed writes left.

A crash or an interrupt before the manifest's PUT leaves the previous version readable (its
manifest and files are untouched) and, at worst, new objects no manifest names; the next
successful write to that URL deletes them. Two writers at once are not excluded (no locks): the
last manifest PUT wins, and files of the losing write may be deleted under it. See docs/storage.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from crossfeed.errors import ConfigError, CrossfeedError, RemoteError
from crossfeed.format.manifest import MANIFEST, Manifest, loads
from crossfeed.io.storage import FsOptions
from crossfeed.write.staging import TMP_PREFIX, crash_point

log = logging.getLogger(__name__)

# a path that starts like a URL ("s3://", "gs:/" — a slash lost to pathlib —, "foo://")
_URL_LIKE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://?")
# the fsspec backend package of the usual schemes, for the error that says what to install
_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "http": "aiohttp",
    "https": "aiohttp",
    "hf": "huggingface_hub",
}
# a shard, index or lengths file a commit names (`crossfeed.write.commit.shard_name`)
_DATASET_FILE = re.compile(r".+-\d{5,}-of-\d{5,}(?:\.g\d{1,18})?\.tfrecord(?:\.gz)?(?:\.idx|\.len)?")


def scheme_of(path) -> str | None:
    """The URL scheme ``path`` starts with (``"s3"``), or None for a plain path (a Windows drive
    letter, ``C:/``, is a path)."""
    s = os.fspath(path)
    m = _URL_LIKE.match(s)
    if m is None or (len(m.group(1)) == 1 and not s.startswith(m.group(1) + "://")):
        return None
    return m.group(1).lower()


def filesystem(url: str, storage_options: Mapping | None = None):
    """fsspec's filesystem for ``url`` and the path in it. An unknown scheme, or one whose backend
    is not installed, is a `ConfigError` naming the scheme and the package to install."""
    scheme = scheme_of(url) or ""
    if not url.startswith(f"{url[: len(scheme)]}://"):
        raise ConfigError(
            f"{url}: looks like a {scheme}:// URL with a slash missing (a path joined by pathlib?); write "
            f"{scheme}://BUCKET/DIR, or ./{url} for a local folder of that name"
        )
    import fsspec

    package = _PACKAGES.get(scheme)
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        raise ConfigError(
            f"{url}: the {scheme}:// scheme needs the fsspec backend {package or 'for it'}, which is not installed; "
            f"pip install {package or '<its fsspec backend>'} ({e})"
        ) from None
    except ValueError:
        raise ConfigError(
            f"{url}: unknown URL scheme {scheme!r}: fsspec has no filesystem for it; use a local path or a URL "
            f"of an installed backend (s3:// with s3fs, gs:// with gcsfs, memory://, …)"
        ) from None
    try:
        return fsspec.core.url_to_fs(url, **FsOptions(storage_options).to_dict())
    except TypeError as e:
        raise ConfigError(
            f"{url}: the {scheme}:// backend refused storage_options {FsOptions(storage_options)!r} ({e}); pass "
            f"only the options of its fsspec filesystem (see docs/storage.md)"
        ) from None


def local_root(path) -> str:
    """A local output directory as an absolute path (``file://`` stripped). A path that looks like
    a URL is refused here: it is written with `write_target`, never as a folder named ``s3:``."""
    s = os.fspath(path)
    if s.startswith("file://"):
        s = s[len("file://") :]
    if scheme_of(s) is not None:
        raise ConfigError(f"{s}: a URL, not a local directory; write to it with write_target (storage_options)")
    root = os.path.abspath(s)
    at = re.fullmatch(r"(.+)@v(\d{1,6})", root)  # how readers spell a version of a dataset: DATASET@vN
    if at and os.path.isfile(os.path.join(at.group(1), MANIFEST)):
        raise ConfigError(
            f"{s}: names version {int(at.group(2))} of the dataset {at.group(1)}, which is read only (a directory "
            f"of this name would hide it from every reader); append to {at.group(1)} (append=True, --append), or "
            f"write to another name"
        )
    return root


@dataclass(frozen=True)
class Target:
    """A write's output: ``url`` (as given: a local path or a URL) and ``root``, the local
    directory the writer writes to (the directory itself, or the staging directory of a URL)."""

    url: str
    root: str
    storage_options: FsOptions = field(default_factory=FsOptions)
    fs: Any = field(default=None, compare=False, repr=False)  # fsspec's filesystem, for a URL
    path: str = ""  # the URL's path inside ``fs``
    old: Manifest | None = None  # the URL's manifest before the write

    @property
    def remote(self) -> bool:
        return self.fs is not None


@contextlib.contextmanager
def write_target(out, *, storage_options: Mapping | None = None, overwrite: bool = False) -> Iterator[Target]:
    """The local directory a write goes to (`Target.root`), published to ``out`` when the block
    ends without an error (see the module docstring). For a local ``out`` the directory is
    created and used as it is; for a URL a staging directory is made and removed afterwards,
    whatever happens. ``overwrite``: an existing non-dataset prefix is written to anyway."""
    s = os.fspath(out)
    if s.startswith("file://") or scheme_of(s) is None:
        root = local_root(s)
        os.makedirs(root, exist_ok=True)
        yield Target(s, root, FsOptions(storage_options))
        return
    fs, path = filesystem(s, storage_options)
    path = path.rstrip("/")
    old = _remote_manifest(fs, path, s)
    if old is None and not overwrite:
        entries = _remote_entries(fs, path)
        if entries:
            raise ConfigError(
                f"{s}: the location is not empty ({', '.join(entries[:3])}{', …' if len(entries) > 3 else ''}) and "
                f"holds no crossfeed dataset; write to a new location, or pass overwrite=True (--overwrite)"
            )
    staging = tempfile.mkdtemp(prefix="crossfeed-stage-")
    try:
        if old is not None:
            with open(os.path.join(staging, MANIFEST), "wb") as f:
                f.write(old.dumps().encode("utf-8"))
        target = Target(s, staging, FsOptions(storage_options), fs, path, old)
        yield target
        publish(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remote_manifest(fs, path: str, url: str) -> Manifest | None:
    where = f"{url.rstrip('/')}/{MANIFEST}"
    try:
        data = fs.cat_file(f"{path}/{MANIFEST}")
    except FileNotFoundError:
        return None
    except Exception as e:  # botocore, aiohttp …: one error family
        raise RemoteError(where, f"cannot read the current manifest ({type(e).__name__}: {e})") from None
    return loads(data, where)


def _remote_entries(fs, path: str) -> list[str]:
    try:
        return sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []
    except Exception as e:
        raise RemoteError(path, f"cannot list the location ({type(e).__name__}: {e})") from None


def publish(target: Target) -> Manifest:
    """Upload what the write committed in ``target.root`` to ``target.url``: every new file under
    its final name, the manifest last (one PUT: the commit point), then delete the old version's
    files and leftovers of crashed writes that the new manifest does not name."""
    fs, path, url = target.fs, target.path, target.url.rstrip("/")
    try:
        with open(os.path.join(target.root, MANIFEST), "rb") as f:
            manifest_bytes = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{url}: the write committed nothing (no manifest in its staging directory)") from None
    new = loads(manifest_bytes, f"{url}/{MANIFEST}")
    names = sorted(n for n in os.listdir(target.root) if n != MANIFEST and not n.startswith(TMP_PREFIX))
    try:
        with contextlib.suppress(Exception):  # object stores have no directories; local-like ones need it
            fs.makedirs(path, exist_ok=True)
        for n in names:
            fs.put_file(os.path.join(target.root, n), f"{path}/{n}")
            crash_point("object uploaded")
        fs.pipe_file(f"{path}/{MANIFEST}", manifest_bytes)
        crash_point("manifest uploaded")  # the commit point: readers see the new version
        if new.data_root is None and (target.old is None or target.old.data_root is None):
            gone = sorted(
                n
                for n in _remote_entries(fs, path)
                if n not in new.files and (n in (target.old.files if target.old else ()) or _DATASET_FILE.fullmatch(n))
            )
            for n in gone:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(f"{path}/{n}")
                crash_point("old object removed")
    except CrossfeedError:
        raise
    except Exception as e:
        raise RemoteError(
            url,
            f"uploading the dataset failed ({type(e).__name__}: {e}); the previous version (if any) is still "
            f"the one readers see; run the conversion again",
        ) from None
    with contextlib.suppress(Exception):  # this process's listings of the location are stale now
        fs.invalidate_cache(path)
    log.info("%s: published %d files and the manifest", url, len(names))
    return new
