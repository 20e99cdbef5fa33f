"""Typed errors of the conversion jobs and the bad-data policy (``on_error``).

A source that meets a bad input (a corrupt image, a CSV row with the wrong column count, a number
that does not parse) hands it to `Skips.bad`: under ``raise`` (the default) that raises
`BadInputError` naming the file and line; under ``skip`` the record is dropped, counted and logged
(rate-limited), until more than ``max_skips`` records were dropped. The budget is checked per work
unit as it reads and again over the whole job when the shards are planned.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from crossfeed.errors import BadInputError, CrossfeedError, DuplicateKeyError, EmptyInputError
from crossfeed.policy import ErrorBudget, OnError

log = logging.getLogger(__name__)
__all__ = ["BadInputError", "DuplicateKeyError", "EmptyInputError", "ErrorPolicy", "OnError", "Skips"]


@dataclass(frozen=True)
class ErrorPolicy:
    """What to do with a bad input record: raise (default) or skip, at most ``max_skips`` of them
    (None: no limit)."""

    mode: OnError = OnError.RAISE
    max_skips: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "mode", OnError(self.mode))
        if self.max_skips is not None and self.max_skips < 0:
            raise CrossfeedError(f"max_skips must be >= 0 or None, got {self.max_skips}")

    def check_total(self, skipped: int, where: str) -> None:
        """Raise when the whole job skipped more records than the budget allows."""
        if self.max_skips is not None and skipped > self.max_skips:
            raise BadInputError(
                f"{where}: {skipped} bad records were skipped, more than the budget of {self.max_skips}; "
                f"fix the input or raise --max-skips"
            )


class Skips:
    """Counts the bad records of one work unit under a policy (`crossfeed.policy.ErrorBudget`)."""

    def __init__(self, policy: ErrorPolicy):
        self.policy = policy
        self._budget = ErrorBudget(policy.max_skips, logger=log, exceed=BadInputError)

    @property
    def count(self) -> int:
        return self._budget.count

    def bad(self, message: str) -> None:
        if self.policy.mode is OnError.RAISE:
            raise BadInputError(f"{message} (pass on_error='skip' / --on-error skip to drop such records)")
        self._budget.skip(message)
