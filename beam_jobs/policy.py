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

from crossfeed.errors import BadInputError, DuplicateKeyError, EmptyInputError
from crossfeed.policy import DEFAULT_MAX_SKIPS, ErrorBudget, OnError, check_max_skips, on_error_choice
from crossfeed.write.options import WriteOptions

log = logging.getLogger(__name__)
__all__ = ["BadInputError", "DuplicateKeyError", "EmptyInputError", "ErrorPolicy", "OnError", "Skips"]


@dataclass(frozen=True)
class ErrorPolicy:
    """What to do with a bad input record: raise (default) or skip, at most ``max_skips`` of them
    (the read side's default budget); `of` takes both from a `WriteOptions`. A bad value is a
    `ConfigError` naming the option, as everywhere."""

    mode: OnError = OnError.RAISE
    max_skips: int = DEFAULT_MAX_SKIPS

    def __post_init__(self):
        object.__setattr__(self, "mode", on_error_choice(self.mode))
        object.__setattr__(self, "max_skips", check_max_skips(self.max_skips))

    @classmethod
    def of(cls, options: WriteOptions) -> ErrorPolicy:
        """The policy of a write's options (``on_error``, ``max_skips``)."""
        return cls(options.on_error, options.max_skips)

    def check_total(self, skipped: int, where: str) -> None:
        """Raise when the whole job skipped more records than the budget allows."""
        if skipped > self.max_skips:
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
