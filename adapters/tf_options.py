"""The validated options of the TensorFlow adapter: which engine, how to shuffle, how to batch.

Made once by `crossfeed.adapters.tf.dataset` / `input_fn` from their keyword arguments; every
check happens here, so the engines receive a `TFOptions` they can trust. The plan engine reads
through the core's own options object: `TFOptions.loader_options` builds the one
`crossfeed.LoaderOptions` (or takes the caller's, whole) that both counts and delivers batches.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from crossfeed.errors import ConfigError
from crossfeed.read.options import LoaderOptions
from crossfeed.read.plan import Shuffle  # the Loader's modes; the native engine treats global and block alike


class Engine(str, enum.Enum):
    """``native``: TFRecordDataset + parse_example, all in TF's C++ runtime.
    ``plan``: the crossfeed Loader's plan, so the order equals the PyTorch adapter's.
    ``auto``: native unless something needs the plan (see `crossfeed.adapters.tf`)."""

    AUTO = "auto"
    NATIVE = "native"
    PLAN = "plan"


def _choice(enum_cls, value, option: str):
    if isinstance(value, bool):  # shuffle=True/False reads naturally
        if enum_cls is Shuffle:
            return Shuffle.GLOBAL if value else Shuffle.NONE
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_cls)
        raise ConfigError(f"{option}={value!r} is not one of {choices}") from None


@dataclass(frozen=True, kw_only=True)
class TFOptions:
    """What to read and how; the engines' one input besides the dataset."""

    split: str = "train"
    batch_size: int | None = None
    shuffle: Shuffle = Shuffle.GLOBAL
    seed: int | None = 0
    epoch: int = 0
    drop_last: bool = False
    features: tuple[str, ...] | None = None
    engine: Engine = Engine.AUTO
    rank: int = 0
    world_size: int = 1
    shuffle_buffer: int = 4096
    repeat: bool = False
    return_index: bool = False
    num_parallel_calls: int | None = None  # None: tf.data.AUTOTUNE
    prefetch: int | None = None  # None: tf.data.AUTOTUNE; 0: no prefetch
    loader: LoaderOptions | None = None  # the plan engine's Loader options, when the caller passed them whole

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "engine", _choice(Engine, self.engine, "engine"))
        set_(self, "shuffle", _choice(Shuffle, self.shuffle, "shuffle"))
        if not isinstance(self.split, str) or not self.split:
            raise ConfigError(f"split must be a non-empty string, got {self.split!r}")
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1
        ):
            raise ConfigError(f"batch_size must be a positive int or None (unbatched), got {self.batch_size!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ConfigError(
                f"seed must be a non-negative int (or None for a nondeterministic shuffle), got {self.seed!r}"
            )
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise ConfigError(f"epoch must be a non-negative int, got {self.epoch!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be an int in [0, world_size={self.world_size}), got {self.rank!r}")
        if not isinstance(self.shuffle_buffer, int) or self.shuffle_buffer < 1:
            raise ConfigError(f"shuffle_buffer must be an int >= 1 records, got {self.shuffle_buffer!r}")
        if self.features is not None:
            if isinstance(self.features, str) or not isinstance(self.features, Sequence) or not self.features:
                raise ConfigError(f"features must be a non-empty list of feature names, got {self.features!r}")
            set_(self, "features", tuple(self.features))
        for name in ("num_parallel_calls", "prefetch"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < (1 if name == "num_parallel_calls" else 0)):
                raise ConfigError(f"{name} must be None (AUTOTUNE) or a positive int, got {v!r}")

    @classmethod
    def from_loader(cls, options: LoaderOptions, **tf_fields) -> TFOptions:
        """TF options that read what a `crossfeed.LoaderOptions` says (passed whole to the plan engine)."""
        plan, shard = options.plan, options.shard
        return cls(
            split=options.split,
            batch_size=plan.batch_size,
            shuffle=plan.shuffle,
            seed=plan.seed,
            drop_last=plan.drop_last,
            features=options.features,
            rank=shard.rank,
            world_size=shard.world_size,
            return_index=options.return_index,
            loader=options,
            **tf_fields,
        )

    def loader_options(self, extra: dict | None = None) -> tuple[LoaderOptions, dict]:
        """``(LoaderOptions, callables)``: the one options object of the plan engine's Loaders (the
        caller's own, or made from these fields and ``extra`` Loader keywords), and the
        ``transform``/``batch_transform`` among ``extra``."""
        extra = dict(extra or {})
        calls = {k: extra.pop(k) for k in ("transform", "batch_transform") if k in extra}
        if self.loader is not None:
            return (self.loader.replace(**extra) if extra else self.loader), calls
        if self.seed is None:
            raise ConfigError("the plan engine needs an int seed (its order is a pure function of it); pass seed=")
        if self.batch_size is None:
            raise ConfigError("the plan engine yields batches; pass batch_size= (or use engine='native' for records)")
        base = dict(
            split=self.split,
            batch_size=self.batch_size,
            shuffle=self.shuffle.value,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
            features=None if self.features is None else list(self.features),
            return_index=self.return_index,
        )
        base.update(extra)
        return LoaderOptions.of(**base), calls
