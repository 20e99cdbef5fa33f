"""Which data roots a dataset may send crossfeed to: a manifest's ``data_root`` is trusted only
inside the dataset's own directory (local) or bucket (the same scheme and host of a URL), or
under a root the user allowed — ``allowed_roots=`` / ``--allow-root`` or the environment variable
``CROSSFEED_ALLOWED_ROOTS`` (comma-separated absolute paths or URLs).

So a dataset from an untrusted place (a download, a shared bucket) cannot make crossfeed open
``/etc/passwd`` or fetch from an arbitrary server: its ``data_root`` is refused, naming the root
and how to allow it. Local paths are compared after resolving symlinks (a link inside the
dataset that points out of it is outside), URLs by their parts (no ``.``/``..`` segments, even
percent-encoded).
"""

from __future__ import annotations

import os
import shlex
import stat
import urllib.parse
from collections.abc import Iterable

from crossfeed.errors import ConfigError, RootNotAllowedError
from crossfeed.format.manifest import url_problem
from crossfeed.io.storage import is_remote

ENV = "CROSSFEED_ALLOWED_ROOTS"
SEPARATOR = ","
MAX_ROOT = 4096


def normalise(root, what: str = "allowed root") -> str:
    """``root`` as roots are compared: a local path absolute (``file://`` dropped), a URL without
    a trailing ``/``; `ConfigError` for anything else."""
    if isinstance(root, os.PathLike):
        root = os.fspath(root)
    if not isinstance(root, str) or not root or len(root) > MAX_ROOT or "\x00" in root:
        raise ConfigError(f"{what} {root!r}: expected a directory path or a URL (at most {MAX_ROOT} characters)")
    if root.startswith("file://"):
        root = root[len("file://") :]
    if not is_remote(root):
        return os.path.abspath(root)
    problem = url_problem(root)
    if problem:
        raise ConfigError(f"{what} {root!r}: {problem}")
    return _strip(root)


def normalise_all(roots, what: str = "allowed_roots") -> tuple[str, ...]:
    """A list of roots (not one bare string: a list of its characters is never meant), normalised."""
    if isinstance(roots, (str, bytes, os.PathLike)) or not isinstance(roots, Iterable):
        raise ConfigError(f"{what} must be a list of directory paths or URLs, got {roots!r}")
    return tuple(normalise(r, what) for r in roots)


def from_env(environ=None) -> tuple[str, ...]:
    """The roots ``CROSSFEED_ALLOWED_ROOTS`` lists (comma-separated; blanks ignored)."""
    text = (os.environ if environ is None else environ).get(ENV, "")
    return tuple(normalise(r.strip(), f"{ENV} entry") for r in text.split(SEPARATOR) if r.strip())


def _inside_local(path: str, parent: str) -> bool:
    p, q = os.path.realpath(path), os.path.realpath(parent)
    return p == q or p.startswith(q.rstrip(os.sep) + os.sep)


def _strip(url: str) -> str:
    """``url`` without trailing ``/`` after its ``scheme://`` (``memory://`` stays whole)."""
    head, rest = url.split("://", 1)
    return f"{head}://{rest.rstrip('/')}"


def _inside_url(url: str, parent: str) -> bool:
    """Whether ``url`` is ``parent`` or under it, part by part: the same scheme, then the same
    host (a ``scheme://`` parent: any host), then whole path segments."""
    a, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(parent)
    if a.scheme.lower() != b.scheme.lower():
        return False
    if not b.netloc and not b.path.strip("/"):
        return True
    if a.netloc.lower() != b.netloc.lower():
        return False
    path, top = a.path.rstrip("/"), b.path.rstrip("/")
    return path == top or path.startswith(top + "/")


def _same_bucket(url: str, dataset_root: str) -> bool:
    a, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(dataset_root)
    return (a.scheme.lower(), a.netloc.lower()) == (b.scheme.lower(), b.netloc.lower())


def resolve(data_root: str) -> str:
    """``data_root`` as it is compared and read: a URL without a trailing ``/``, a local path
    absolute with its symlinks resolved (once, here: what is read is what was checked)."""
    return _strip(data_root) if is_remote(data_root) else os.path.realpath(normalise(data_root, "data_root"))


def within(root: str, dataset_root: str, allowed: Iterable[str] = ()) -> bool:
    """Whether the resolved ``root`` lies inside the dataset's directory ``dataset_root`` (local)
    or its bucket (remote: the same scheme and host), or under one of ``allowed``."""
    if is_remote(root):
        return (is_remote(dataset_root) and _same_bucket(root, dataset_root)) or any(
            is_remote(a) and _inside_url(root, a) for a in allowed
        )
    return (not is_remote(dataset_root) and _inside_local(root, dataset_root)) or any(
        not is_remote(a) and _inside_local(root, a) for a in allowed
    )


def how_to_allow(root: str) -> str:
    """The three ways to allow ``root``, spelled out to copy: the keyword, the flag, the variable."""
    quoted = shlex.quote(root)
    return f"allowed_roots=[{root!r}], --allow-root {quoted}, or {ENV}={quoted}"


def check_own_file(path: str, dataset_root: str, allowed: Iterable[str], error) -> None:
    """A local file that belongs to the dataset at ``dataset_root`` (a kept manifest, a weights
    file), checked before it is opened: a regular file — else ``error(message)`` (a FIFO would block
    its reader for ever, a directory is no file) — that, through any symbolic link, lies inside the
    dataset or under a root in ``allowed`` or `ENV` — else `RootNotAllowedError`, naming the link
    and how to allow its target. A missing file passes: its reader reports it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise error(f"{path}: not a regular file (a directory, FIFO or device); move it away")
    check_inside(path, dataset_root, allowed)


def check_inside(path: str, dataset_root: str, allowed: Iterable[str]) -> None:
    """`RootNotAllowedError` naming ``path`` (a local file or folder of the dataset at
    ``dataset_root``) and how to allow its target, when through a symbolic link it lies outside
    the dataset and under no root in ``allowed`` or `ENV`."""
    real = os.path.realpath(path)
    if not within(real, os.path.realpath(dataset_root), (*allowed, *from_env())):
        what = os.path.dirname(real) if os.path.isfile(real) else real
        raise RootNotAllowedError(
            f"{path}: a symbolic link to {real}, outside the dataset ({dataset_root}); crossfeed follows links "
            f"out of a dataset only to a root you allow: {how_to_allow(what)}"
        )


def check_data_root(data_root: str, dataset_root: str, allowed: Iterable[str], where: str) -> str:
    """The root to read ``data_root`` (a manifest's, ``where``) from, if it may be read: inside
    the dataset (`within`) or under a root in ``allowed`` or `ENV`. Otherwise `RootNotAllowedError`,
    naming the root and how to allow it."""
    if is_remote(data_root):
        problem = url_problem(data_root)
        if problem:
            raise RootNotAllowedError(f"{where}: data_root {data_root!r}: {problem}; fix the manifest")
    root = resolve(data_root)
    if not within(root, dataset_root, (*allowed, *from_env())):
        raise RootNotAllowedError(
            f"{where}: data_root {root!r} lies outside the dataset ({dataset_root}), and crossfeed reads data outside "
            f"a dataset only under a root you allow. If you trust this dataset, allow its root: {how_to_allow(root)}"
        )
    return root
