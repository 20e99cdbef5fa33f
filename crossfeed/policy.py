"""The bad-data policy, one implementation for readers and writers: ``on_error="raise"`` (the
default) raises at the first bad record; ``on_error="skip"`` drops bad records, each counted and
logged (rate-limited: the first few, then every 100th), until more than ``max_skips`` were
dropped — then it raises with the last one's message. One default budget (`DEFAULT_MAX_SKIPS`)
and one check for both sides (`ReadOptions`, `WriteOptions`)."""

from __future__ import annotations

import enum
import logging
import threading

from crossfeed.errors import ConfigError, CrossfeedError

# the most bad records ``on_error="skip"`` drops before it raises, reading or writing
DEFAULT_MAX_SKIPS = 1000


class OnError(str, enum.Enum):
    RAISE = "raise"  # the first bad record raises, naming its file and place
    SKIP = "skip"  # bad records are dropped, counted and logged, up to a budget


def on_error_choice(value) -> OnError:
    """``value`` ("raise", "skip" or a member) as an `OnError`, or a ConfigError naming the option."""
    try:
        return OnError(value.value if isinstance(value, enum.Enum) else value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in OnError)
        raise ConfigError(f"on_error={value!r} is not one of {choices}") from None


def check_max_skips(value) -> int:
    """``max_skips`` as an int >= 0, or a ConfigError naming the option."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value.__index__()) < 0:
        raise ConfigError(f"max_skips must be an integer >= 0, got {value!r}")
    return int(value.__index__())


class ErrorBudget:
    """Counts skipped bad records against ``max_skips`` (None: no limit). Thread-safe.

    ``budget.skip(err)`` logs ``err`` (rate-limited, on ``logger``) and raises ``exceed(message)``
    once more than ``max_skips`` were skipped.
    """

    LOG_FIRST = 10
    LOG_EVERY = 100

    def __init__(self, max_skips: int | None, *, logger: logging.Logger, exceed: type[CrossfeedError] = CrossfeedError):
        self.max_skips = max_skips
        self.count = 0
        self._log, self._exceed = logger, exceed
        self._lock = threading.Lock()

    def skip(self, err: Exception | str) -> None:
        with self._lock:
            self.count += 1
            n = self.count
        if n <= self.LOG_FIRST or n % self.LOG_EVERY == 0:
            self._log.warning("skipped bad record #%d: %s", n, err)
        if self.max_skips is not None and n > self.max_skips:
            exc = self._exceed(f"more than {self.max_skips} bad records skipped (max_skips); the last: {err}")
            if isinstance(err, BaseException):
                raise exc from err
            raise exc

    __call__ = skip
