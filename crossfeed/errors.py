"""The one exception hierarchy of crossfeed: everything raised on purpose derives from
`CrossfeedError`, so a caller can catch the whole family with one clause."""

from __future__ import annotations

import re

# A URL's userinfo (``scheme://user:password@``, up to its last ``@`` before the path) and the
# values of query parameters whose names look like credentials (``?token=``, ``&X-Amz-Signature=``,
# ``sig``, ``key``, ``password`` …): what `redact` hides.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")
_SECRET_QUERY = re.compile(
    r"(?P<name>[?&;](?:x-amz-[^=&#\s]*|x-goog-[^=&#\s]*|[^=&#\s]*(?:token|sig|signature|key|password|passwd|pwd"
    r"|secret|credential|auth|session)[^=&#\s]*))=[^&#\s]*",
    re.IGNORECASE,
)
REDACTED = "***"


def redact(text: str) -> str:
    """``text`` with every URL's userinfo and credential-looking query values replaced by
    ``***`` (``http://alice:hunter2@host/d?token=t&n=1`` → ``http://***@host/d?token=***&n=1``):
    what crossfeed does to any text it shows or logs that may hold a URL. Every
    `CrossfeedError` message passes through it; the URL that is fetched keeps its secrets."""
    if "@" not in text and "=" not in text:
        return text
    return _SECRET_QUERY.sub(rf"\g<name>={REDACTED}", _USERINFO.sub(rf"\g<scheme>{REDACTED}@", text))


class CrossfeedError(Exception):
    """Base of every error crossfeed raises on purpose. Its message is `redact`-ed: a URL's
    password or token never reaches a traceback, a log line or the CLI's ``error:`` line."""

    def __init__(self, *args):
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class ConfigError(CrossfeedError, ValueError):
    """An option or argument is invalid; the message names the option and the fix."""


class DatasetNotFoundError(CrossfeedError, FileNotFoundError):
    """A path holds no crossfeed dataset (no manifest), or a file of it is missing."""


class RootNotAllowedError(CrossfeedError):
    """A manifest's ``data_root`` lies outside the dataset and under no root the user allowed
    (`crossfeed.io.roots`); the message names the root and how to allow it."""


class DatasetRewrittenError(CrossfeedError):
    """The dataset was rewritten (a new version committed) while a reader had it open, and a
    file of the version it read is gone or changed: reopen it to read the new version."""


class SplitNotFoundError(CrossfeedError, KeyError):
    """A dataset has no split of that name; the message lists the splits it has."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ManifestError(CrossfeedError):
    """The manifest cannot be parsed or disagrees with the files beside it."""


class SchemaError(CrossfeedError, ValueError):
    """A sample or record does not match the dataset's schema."""


class CorruptRecordError(CrossfeedError):
    """A TFRecord frame failed its checks; names the file and the byte offset."""

    def __init__(self, path: str, offset: int, reason: str):
        self.path = redact(str(path))
        self.offset = int(offset)
        self.reason = redact(reason)
        super().__init__(f"{self.path}: corrupt record at byte offset {self.offset}: {reason}")

    def __reduce__(self):  # its constructor's arguments: it crosses from a worker process as data
        return type(self), (self.path, self.offset, self.reason)


class SampleSchemaError(SchemaError):
    """A `SchemaError` of one sample of a batch: ``index`` is its position, ``reason`` what
    encoding that sample alone would have said."""

    def __init__(self, message: str, index: int = -1, reason: str = ""):
        super().__init__(message)
        self.index, self.reason = index, reason or message

    def __reduce__(self):
        return type(self), (self.args[0], self.index, self.reason)


class IndexFileError(CrossfeedError):
    """An index file is malformed or points outside its shard."""


class WorkerError(CrossfeedError):
    """A worker process of the process executor raised (its traceback is in the message) or died
    (its exit signal is); the message names the batch it was building."""


class WireError(CrossfeedError):
    """A network message is malformed, truncated, oversized or of an unknown version."""


class ServerLostError(CrossfeedError):
    """A server of a `connect()` stream never answered, went silent, restarted or reported a
    failure: what it had not delivered will not come (a finished epoch looks different: it ends
    the iteration). `address` and `reason` say which and what; `connect(..., on_loss="continue")`
    reads on from the other servers instead and lists the dropped ones in `client.lost`."""

    def __init__(self, address: str, reason: str):
        self.address = address
        self.reason = reason
        super().__init__(
            f"server {address} lost: {reason}. Check that it runs and is reachable (and that "
            f"client and server agree on CURVE keys); pass on_loss='continue' to read on without it"
        )


class RemoteError(CrossfeedError):
    """A remote file (an fsspec URL) could not be read: the server could not be reached, answered
    an error, or stalled past the read deadline (``read_timeout``, ``$CROSSFEED_READ_TIMEOUT``).
    ``url`` names the file, ``reason`` says what happened; ``transient`` is whether trying again
    may help (the shard cache tries such reads again)."""

    def __init__(self, url: str, reason: str, transient: bool = True):
        self.url, self.reason, self.transient = redact(str(url)), redact(reason), bool(transient)
        super().__init__(f"{self.url}: {reason}")

    def __reduce__(self):  # its constructor's arguments: it crosses from a worker process as data
        return type(self), (self.url, self.reason, self.transient)


class ExampleError(CrossfeedError):
    """Bytes that are not a well-formed ``tf.train.Example``."""


class BadInputError(CrossfeedError):
    """(conversion) A source record cannot be read or parsed; the message names the file and line or row."""


class DuplicateKeyError(CrossfeedError):
    """Two samples of one split have the same key; the message names the key."""


class EmptyInputError(CrossfeedError):
    """The input produced no samples (or a split received none)."""


class JournalError(CrossfeedError):
    """A dispatcher journal cannot be trusted: a record failed its checksum or its checks, or the
    file is a link; the message names the file, the line and its byte offset, and the way out."""


# The optional extras (pyproject's [project.optional-dependencies]) by the top-level module that
# needs them: what `MissingExtraError` names when that module cannot be imported.
EXTRAS = {
    "apache_beam": "beam",
    "dask": "beam",
    "distributed": "beam",
    "pyarrow": "beam",
    "tensorflow": "tf",
    "torch": "torch",
    "jax": "jax",
    "jaxlib": "jax",
    "grain": "grain",
    "tokenizers": "text",
    "prometheus_client": "metrics",
    "rich": "metrics",
    "aiohttp": "http",
    "requests": "http",
}


class MissingExtraError(CrossfeedError, ImportError):
    """Something needs an optional package that is not installed: the message names the package
    and the extra that installs it, in one line (``pip install 'crossfeed[beam]'``). Also an
    ImportError, so ``try: import crossfeed.adapters.torch except ImportError`` keeps working."""

    def __init__(self, what: str, module: str, extra: str | None = None):
        self.what, self.module = what, module
        self.extra = extra or EXTRAS.get(module.partition(".")[0])
        how = f"pip install 'crossfeed[{self.extra}]'" if self.extra else f"pip install {module}"
        super().__init__(f"{what} needs {module}, which is not installed: {how}")
        self.name = module

    def __reduce__(self):
        return type(self), (self.what, self.module, self.extra)


def missing_extra(error: ImportError, what: str) -> ImportError:
    """``error`` (an import that failed) as a `MissingExtraError` for ``what`` when the missing
    module is one an extra installs; else ``error`` itself (a broken install: keep its story).
    Use: ``except ModuleNotFoundError as e: raise missing_extra(e, "crossfeed.adapters.torch") from None``."""
    if isinstance(error, MissingExtraError):
        return error
    name = getattr(error, "name", None) or ""
    if name.partition(".")[0] in EXTRAS:
        return MissingExtraError(what, name.partition(".")[0])
    return error


def require(module: str, what: str, extra: str | None = None):
    """``import module`` (returned), or a `MissingExtraError` saying ``what`` needs it and which
    extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != module.partition(".")[0]:
            raise  # the module is there but one of its own imports is missing: keep its story
        raise MissingExtraError(what, module.partition(".")[0], extra) from None
