"""The options of a write: one frozen, validated object, passed whole.

``WriteOptions`` holds how a dataset is laid out (``num_shards`` or ``shard_size``, ``compress``)
and what a bad input record does (``on_error``, ``max_skips``). `crossfeed.write_dataset`, the
Beam job (`crossfeed.beam_jobs.job.convert`, `WriteDataset`) and ``crossfeed convert`` take this
one object — or its fields as keywords, through `WriteOptions.given` — so each default and each
check exists once:

    opts = WriteOptions(shard_size="64MB", compress=True)          # validated where it is made
    crossfeed.write_dataset("out/", samples, options=opts)         # or shard_size="64MB", ...
"""

from __future__ import annotations

import dataclasses

from crossfeed.config import parse_size
from crossfeed.errors import ConfigError
from crossfeed.policy import DEFAULT_MAX_SKIPS, OnError, check_max_skips, on_error_choice

DEFAULT_SHARD_SIZE = 256 << 20  # 256 MiB: the TFRecord guide's 100–200 MB shards, rounded up


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """How a dataset is written.

    ``num_shards``: exactly this many shards per split (samples round-robin); otherwise a new
    shard starts every ``shard_size`` bytes (a byte count or a size such as ``"256MB"``,
    ``"1.5GiB"``: the grammar of every size option). ``compress``: GZIP the shards.
    ``on_error``: a bad input record (a corrupt image, a CSV row that does not parse) raises
    (``"raise"``, the default) or is dropped, counted and logged (``"skip"``), until more than
    ``max_skips`` were dropped — the read side's default budget, `crossfeed.policy.DEFAULT_MAX_SKIPS`.
    """

    num_shards: int | None = None
    shard_size: int = DEFAULT_SHARD_SIZE  # given as bytes or a size such as "256MB"; kept as bytes
    compress: bool = False
    on_error: OnError = OnError.RAISE  # given as the enum or its value
    max_skips: int = DEFAULT_MAX_SKIPS

    def __post_init__(self):
        n = self.num_shards
        if n is not None:
            if isinstance(n, bool) or not hasattr(n, "__index__") or int(n.__index__()) < 1:
                raise ConfigError(f"num_shards must be an integer >= 1 (or None: by shard_size), got {n!r}")
            object.__setattr__(self, "num_shards", int(n.__index__()))
        object.__setattr__(self, "shard_size", parse_size(self.shard_size, "shard_size"))
        if not isinstance(self.compress, bool):
            raise ConfigError(f"compress must be True or False, got {self.compress!r}")
        object.__setattr__(self, "on_error", on_error_choice(self.on_error))
        object.__setattr__(self, "max_skips", check_max_skips(self.max_skips))

    @classmethod
    def given(cls, options: WriteOptions | None, fields: dict, *, who: str = "write_dataset") -> WriteOptions:
        """The options a writer was given: ``options`` whole, or ``fields`` (keywords of this
        class) — not both; an unknown keyword names the known ones."""
        if options is not None:
            if fields:
                raise ConfigError(f"{who}: pass either a WriteOptions or keywords, not both (got {sorted(fields)})")
            if not isinstance(options, cls):
                raise ConfigError(f"{who}: options must be a WriteOptions, got {type(options).__name__}")
            return options
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise ConfigError(f"{who}: unknown write option(s) {unknown}; the options are {sorted(known)}")
        return cls(**fields)

    def replace(self, **changes) -> WriteOptions:
        """A copy with fields changed by name (validated again)."""
        return WriteOptions.given(None, {**dataclasses.asdict(self), **changes}, who="WriteOptions.replace")
