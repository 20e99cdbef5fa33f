"""The last step of a job: `crossfeed.write.commit.commit_splits` publishes every split's staged
shards with one atomic rename of the manifest (journal, shards under fresh names, manifest, old
files removed). A job killed at any point leaves the old dataset or the new one, whole.
Temporary files are named ``.tmp-<token>-…``; `remove_temporaries` clears one job's (on failure)
or those of writers that are gone (stale ones, after a commit).
"""

from __future__ import annotations

import logging
import os

from crossfeed.beam_jobs.handoff import FINISHING
from crossfeed.beam_jobs.records import STAGED
from crossfeed.write.commit import commit_splits, dataset_lock, remove_entry, remove_stale
from crossfeed.write.staging import TMP_PREFIX

__all__ = ["TMP_PREFIX", "commit_splits", "remove_temporaries"]

log = logging.getLogger(__name__)


def remove_temporaries(root: str, *, token: str | None = None, keep: str | None = None) -> int:
    """Delete the ``.tmp-*`` entries of ``root`` of job ``token``; without ``token``, those of
    every writer that is gone (`remove_stale`: a running `write_dataset` keeps its files), but
    ``keep``'s. Returns how many were removed. Job ``token``'s batches held in this process's
    memory (`crossfeed.beam_jobs.records.STAGED`) are dropped too, once its shards being finished
    on threads (`crossfeed.beam_jobs.handoff.FINISHING`) are."""
    if token is not None:
        FINISHING.drop(token)
        STAGED.drop(token)
    if not os.path.isdir(root):
        return 0
    if token is None:
        with dataset_lock(root):
            return remove_stale(root, keep=keep)
    removed = 0
    for name in os.listdir(root):
        if not name.startswith(f"{TMP_PREFIX}{token}"):
            continue
        removed += remove_entry(os.path.join(root, name))
    if removed:
        log.info("%s: removed %d temporary files of job %s", root, removed, token)
    return removed
