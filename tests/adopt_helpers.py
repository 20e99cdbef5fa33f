"""Proof that adoption leaves a data directory as it was: a snapshot of everything a write could
change, a context that makes the directory read-only, and an indexing script run under an audit
hook that fails any write inside it (tests run as root, which writes through any file mode); and
the roots such tests allow a data_root in (`trusted_roots`)."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def snapshot(root: Path) -> dict:
    """Names, sizes, mtimes, modes and sha256 of a directory's files, and the directory's own."""
    out = {".": (os.stat(root).st_mtime_ns, os.stat(root).st_mode)}
    for p in sorted(root.iterdir()):
        st = p.stat()
        out[p.name] = (st.st_size, st.st_mtime_ns, st.st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@contextlib.contextmanager
def read_only(root: Path) -> Iterator[None]:
    """``root`` and its files read-only for the block, writable again after it."""
    for p in [*root.iterdir(), root]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        yield
    finally:
        for p in [root, *root.iterdir()]:
            p.chmod(0o755 if p.is_dir() else 0o644)


# `crossfeed index ARGS...` (through the CLI's entry module) under an audit hook that fails any
# open for writing, rename, removal or mode change inside the data directory (the first argument).
INDEX_AUDITED = """
import os, runpy, sys
data = os.path.realpath(sys.argv[1])
def inside(p):
    try:
        return isinstance(p, (str, bytes, os.PathLike)) and (
            os.path.realpath(os.fsdecode(p)) + os.sep).startswith(data + os.sep)
    except (TypeError, ValueError):
        return False
def hook(event, args):
    if event == "open" and inside(args[0]):
        mode, flags = args[1], args[2]
        writes = any(c in (mode or "") for c in "wax+") or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writes:
            raise PermissionError(f"adoption opened {args[0]} for writing")
    elif event in ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.utime", "os.truncate",
                   "os.link", "os.symlink", "shutil.rmtree") and any(inside(a) for a in args[:2]):
        raise PermissionError(f"adoption did {event} on {args[:2]}")
sys.addaudithook(hook)
sys.argv = ["crossfeed", "index", *sys.argv[1:]]
runpy.run_module("crossfeed.cli.main", run_name="__main__")
"""


@pytest.fixture(autouse=True)
def trusted_roots(monkeypatch, tmp_path_factory):
    """Tests that index data in their own temporary directories and buckets allow those roots (a
    data_root outside its dataset is refused otherwise: test_trust_dataset.py), in the environment
    so that the CLI and the Python children they start inherit it. Autouse where imported."""
    monkeypatch.setenv("CROSSFEED_ALLOWED_ROOTS", f"{tmp_path_factory.getbasetemp()},memory://,s3://data")
