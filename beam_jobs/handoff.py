"""A shard's finishing (its sha256 and CRC32C, index and lengths files, the fsync of all three)
handed to a thread while its writer goes on to the next shard — only on a runner that runs every
step in this process (`steps.WriteConfig.memory_budget`), as the batches held in memory are.

At most one shard of a job is in flight: handing one off first waits for the one before, and
raises its error. What crosses to the commit is a `PendingShard` handle; the commit waits for it
(`FINISHING.result`), and a failed finishing raises there, naming the shard. Every thread has
ended when the job commits, or when it fails and `crossfeed.beam_jobs.commit.remove_temporaries`
drops the job's hand-offs (`ShardFinishing.drop`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from crossfeed.errors import CrossfeedError
from crossfeed.write.staging import StagedShard


@dataclass(frozen=True)
class PendingShard:
    """Shard ``index`` of ``split``, being finished by a thread of this process (`FINISHING`)."""

    split: str
    index: int

    def resolve(self, token: str) -> StagedShard:
        """The staged shard, once finished (job ``token``'s); raises what finishing it raised."""
        return FINISHING.result(token, self.split, self.index)


class _Finish:
    """One shard's finishing, on a thread of its own."""

    def __init__(self, what: str, fn: Callable[[], StagedShard]):
        self.what = what
        self.value: StagedShard | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), name="crossfeed-finish-shard", daemon=True)

    def _run(self, fn: Callable[[], StagedShard]) -> None:
        try:
            self.value = fn()
        except BaseException as e:  # kept for whoever waits: the commit, or the next hand-off
            self.error = e

    def wait(self) -> StagedShard:
        self.thread.join()
        if self.error is not None:
            raise CrossfeedError(
                f"{self.what}: finishing it failed ({type(self.error).__name__}: {self.error}); nothing was "
                f"committed — fix the cause (space, permissions of the output directory) and run the job again"
            ) from self.error
        assert self.value is not None
        return self.value


class ShardFinishing:
    """The shards of each job (by token) being finished, or finished, on threads of this process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[tuple[str, int], _Finish]] = {}
        self._last: dict[str, _Finish] = {}  # each job's latest hand-off: the only one that can be in flight

    def hand_off(self, token: str, split: str, index: int, what: str, fn: Callable[[], StagedShard]) -> PendingShard:
        """Run ``fn`` (which finishes shard ``index`` of ``split``, described as ``what`` in
        errors) on a thread, once no other shard of job ``token`` is in flight; raises the error
        of the one before, if it failed."""
        while True:
            with self._lock:
                last = self._last.get(token)
                if last is None or not (last.thread.is_alive() or last.error is not None):
                    f = self._jobs.setdefault(token, {})[(split, index)] = self._last[token] = _Finish(what, fn)
                    f.thread.start()
                    return PendingShard(split, index)
            last.wait()  # the one in flight (raising its error); then try again

    def result(self, token: str, split: str, index: int) -> StagedShard:
        with self._lock:
            got = self._jobs.get(token, {}).get((split, index))
        if got is None:
            raise CrossfeedError(
                f"shard {index} of split {split!r}: it was finished by a process this step does not share; "
                f"run the job on the in-process runner, or stage on disk (WriteDataset(stage_in_memory=0))"
            )
        return got.wait()

    def drop(self, token: str) -> None:
        """Forget job ``token``'s shards, once every thread finishing one has ended."""
        with self._lock:
            job = self._jobs.pop(token, {})
            self._last.pop(token, None)
        for f in job.values():
            f.thread.join()


FINISHING = ShardFinishing()  # this process's
