"""The last step of a job: `crossfeed.write.writer.commit_splits` moves every split's staged shards
into place and writes one manifest, last. A job killed at any point leaves either the old dataset
untouched (killed before that step) or no manifest at all, never a mix a reader accepts.
Temporary files are named ``.tmp-<token>-…``; `remove_temporaries` clears one job's (on failure) or
every other job's (stale ones, on success).
"""

from __future__ import annotations

import logging
import os
import shutil

from crossfeed.write.writer import commit_splits

__all__ = ["TMP_PREFIX", "commit_splits", "remove_temporaries"]

log = logging.getLogger(__name__)
TMP_PREFIX = ".tmp-"


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
