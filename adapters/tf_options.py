"""The options of the TensorFlow adapter: the core's one `crossfeed.LoaderOptions`, plus the few
knobs only TensorFlow has (which engine, tf.data's parallelism and prefetch, the native shuffle
buffer, repetition).

`TFOptions.make` is the one place the adapter turns keywords into options: every Loader field
(``split``, ``batch_size``, ``shuffle``, ``seed``, ``rank`` … ``num_threads``, ``on_error``) goes
through `LoaderOptions.of` — the same defaults and the same validation as ``crossfeed.Loader`` —
and two values only TensorFlow gives a meaning to are kept beside it: ``batch_size=None``
(records, not batches: tf.data's unbatched form) and ``seed=None`` (every worker shuffles its
own way: ParameterServerStrategy), both for the native engine. ``seed=None`` is refused, with
the Loader's message, unless ``engine="native"`` is said: as in every other front end, an
unseeded order is never picked for the user.
"""

from __future__ import annotations

import dataclasses
import enum

from crossfeed.errors import ConfigError
from crossfeed.read.options import LoaderOptions, Shuffle, check_seed, choice


class Engine(str, enum.Enum):
    """``native``: TFRecordDataset + parse_example, all in TF's C++ runtime.
    ``plan``: the crossfeed Loader's plan, so the order equals the PyTorch adapter's.
    ``auto``: native unless something needs the plan (see `crossfeed.adapters.tf`)."""

    AUTO = "auto"
    NATIVE = "native"
    PLAN = "plan"


def _count(value, name: str, lo: int):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
        raise ConfigError(f"{name} must be None (AUTOTUNE) or an int >= {lo}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class TFOptions:
    """What to read and how (``loader``, whole), and TensorFlow's own knobs."""

    loader: LoaderOptions
    batched: bool = True  # False: batch_size=None — records one by one (native engine)
    seeded: bool = True  # False: seed=None — a fresh shuffle on every worker (native engine)
    whole: bool = False  # the caller passed the LoaderOptions whole: the plan engine reads them
    tail_chosen: bool = True  # False: drop_last not given: a state='s tail is followed (`identity.follow_tail`)
    engine: Engine = Engine.AUTO
    epoch: int = 0
    shuffle_buffer: int = 4096  # the native engine's shuffle buffer, in records
    repeat: bool = False
    num_parallel_calls: int | None = None  # None: tf.data.AUTOTUNE
    tf_prefetch: int | None = None  # tf.data's prefetch, in elements (None: AUTOTUNE; 0: none)
    keep_dtypes: bool = False  # unsigned integers as stored (else int32/int64: `crossfeed.adapters.int_dtypes`)

    def __post_init__(self):
        object.__setattr__(self, "engine", choice(Engine, self.engine, "engine"))
        if not isinstance(self.loader, LoaderOptions):
            raise ConfigError(f"options must be a crossfeed.LoaderOptions, got {type(self.loader).__name__}")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ConfigError(f"epoch must be a non-negative int, got {self.epoch!r}")
        if isinstance(self.shuffle_buffer, bool) or not isinstance(self.shuffle_buffer, int) or self.shuffle_buffer < 1:
            raise ConfigError(f"shuffle_buffer must be an int >= 1 records, got {self.shuffle_buffer!r}")
        _count(self.num_parallel_calls, "num_parallel_calls", 1)
        _count(self.tf_prefetch, "tf_prefetch", 0)
        object.__setattr__(self, "keep_dtypes", bool(self.keep_dtypes))

    @classmethod
    def make(cls, options: LoaderOptions | None = None, fields: dict | None = None, **tf_fields) -> TFOptions:
        """``options`` whole, or Loader ``fields`` as keywords (not both), with TF's own ``tf_fields``."""
        fields = dict(fields or {})
        if options is not None:
            if fields:
                raise ConfigError(f"options= carries {sorted(fields)}; pass them in the LoaderOptions, not both")
            if not isinstance(options, LoaderOptions):
                raise ConfigError(f"options must be a crossfeed.LoaderOptions, got {type(options).__name__}")
            return cls(loader=options, whole=True, **tf_fields)
        batched, seeded = fields.get("batch_size") is not None, "seed" not in fields or fields["seed"] is not None
        fields["batch_size"] = fields.get("batch_size") if batched else 1
        if not seeded:
            if choice(Engine, tf_fields.get("engine", Engine.AUTO), "engine") is not Engine.NATIVE:
                try:
                    check_seed(None)  # every front end refuses it with the Loader's words …
                except ConfigError as e:
                    raise ConfigError(
                        f"{e} (… but TensorFlow's native engine, whose order is tf.data's own shuffle, takes "
                        "seed=None as tf.data does: a fresh order on every worker, for ParameterServerStrategy; "
                        "say engine='native' to choose it)"
                    ) from None
            fields.pop("seed")
        if "features" in fields and fields["features"] is not None and not fields["features"]:
            raise ConfigError("features must be a non-empty list of feature names, got []")
        chosen = "drop_last" in fields
        return cls(loader=LoaderOptions.of(**fields), batched=batched, seeded=seeded, tail_chosen=chosen, **tf_fields)

    def replace(self, **changes) -> TFOptions:
        """A copy with TF fields or Loader fields changed by name."""
        mine = {f.name for f in dataclasses.fields(self)}
        loader = {k: v for k, v in changes.items() if k not in mine}
        tf = {k: v for k, v in changes.items() if k in mine}
        if "batch_size" in loader:
            tf["batched"] = True
        return dataclasses.replace(self, loader=self.loader.replace(**loader) if loader else self.loader, **tf)

    # what the engines read, from the one LoaderOptions
    @property
    def split(self) -> str:
        return self.loader.split

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size if self.batched else None

    @property
    def shuffle(self) -> Shuffle:
        return self.loader.plan.shuffle

    @property
    def seed(self) -> int | None:
        return self.loader.plan.seed if self.seeded else None

    @property
    def drop_last(self) -> bool:
        return self.loader.plan.drop_last

    @property
    def features(self) -> tuple[str, ...] | None:
        return self.loader.features

    @property
    def rank(self) -> int:
        return self.loader.rank

    @property
    def world_size(self) -> int:
        return self.loader.world_size

    @property
    def return_index(self) -> bool:
        return self.loader.return_index

    def loader_options(self, extra: dict | None = None) -> tuple[LoaderOptions, dict]:
        """``(LoaderOptions, callables)`` of the plan engine's Loaders: this one options object
        (with ``extra`` Loader fields applied) and the ``transform``/``batch_transform`` among ``extra``."""
        extra = dict(extra or {})
        calls = {k: extra.pop(k) for k in ("transform", "batch_transform", "filter") if k in extra}
        if not self.seeded:
            raise ConfigError("the plan engine needs an int seed (its order is a pure function of it); pass seed=")
        return (self.loader.replace(**extra) if extra else self.loader), calls
