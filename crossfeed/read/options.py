"""The options of a read pipeline: one frozen, validated object, passed whole.

``LoaderOptions`` groups what to read (split, features), how to order it (`PlanOptions`), how to
split it across ranks and workers (`ShardOptions`) and how hard to work (`ReadOptions`). The
Loader, both framework adapters, ``input_fn``, ``crossfeed serve`` and ``crossfeed bench`` take
this one object and hand it on unchanged; none of them re-spells its fields.

    opts = LoaderOptions.of(batch_size=256, shuffle="global", seed=0)      # keywords, validated
    opts = opts.replace(rank=1, world_size=4)                              # any field, by name
    Loader("data/", opts)
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

from crossfeed.config import parse_size
from crossfeed.errors import ConfigError
from crossfeed.format.schema import ImageFit
from crossfeed.io import roots
from crossfeed.io.cache import ENV as CACHE_ENV
from crossfeed.io.storage import FsOptions, read_deadline
from crossfeed.policy import DEFAULT_MAX_SKIPS, OnError, check_max_skips, on_error_choice
from crossfeed.read.env import rank_and_world
from crossfeed.read.executors.threads import ExecutorKind
from crossfeed.read.schedule import Schedule
from crossfeed.read.skips import Skip


class Shuffle(str, enum.Enum):
    GLOBAL = "global"  # an exact permutation of the split (random access through the index)
    BLOCK = "block"  # windows of shards, each shard read once and sequentially (remote data)
    NONE = "none"  # file order


class Resize(str, enum.Enum):
    """How a decoded image is brought to ``image_size`` (see `ReadOptions`)."""

    STRETCH = "stretch"  # scaled to (H, W) whatever its aspect ratio (Keras' image_dataset_from_directory)
    CROP = "crop"  # scaled to cover (H, W), aspect kept, then the centre cut out
    PAD = "pad"  # scaled to fit inside (H, W), aspect kept, the rest filled with zeros


# Bounds of what an option makes a reader allocate, checked where the option is made (a batch is
# allocated whole): a batch of at most 2^24 samples, a packed row of at most 2^24 tokens, a batch of
# at most 2^32 tokens (packed: batch_size × length; batch_by_tokens). What the dataset bounds (a
# pad_id within the token dtype) is checked where the dataset is known, before the first batch.
MAX_BATCH_SIZE = 1 << 24
MAX_PACK_LENGTH = 1 << 24
MAX_BATCH_TOKENS = 1 << 32


class PackSplit(str, enum.Enum):
    """How `Pack` cuts the epoch's documents into rows (docs/sequences.md)."""

    DOCUMENTS = "documents"  # best-fit into a bounded set of open rows: a document is cut only when longer than a row
    ROWS = "rows"  # concatenate and chunk: no padding but the epoch's last row; documents cut at row ends


class PackLong(str, enum.Enum):
    """What `Pack` does with a document longer than a row."""

    SPLIT = "split"  # cut into pieces of a row each (the last piece packed like a document)
    DROP = "drop"  # left out (counted and logged)


class WeightsBy(str, enum.Enum):
    """What a packed mixture's weights count."""

    DOCUMENTS = "documents"  # each source's share of the epoch's documents is exact (as any mixture's)
    TOKENS = "tokens"  # each source's share of the epoch's tokens, to within a document (pack.TokenMixtureOrder)


@dataclasses.dataclass(frozen=True)
class Pack:
    """Sequence packing (`crossfeed.read.stages.pack`): the documents of the epoch, in plan order,
    packed into dense rows of ``length`` tokens. A batch holds ``(B, length)`` arrays of each of
    ``features`` (variable-length integer features of equal length per record, e.g. tokens and
    their loss mask; padding is ``pad_id``) and ``segment_ids``/``positions`` ``(B, length)``
    int32: the document's number within its row (1, 2 …; 0 on padding) and the position within
    its piece. ``split`` "documents" (best-fit into ``bins`` open rows) or "rows" (concatenate
    and chunk); ``long`` "split" or "drop" documents longer than ``length``; ``segments=False``:
    batches of ``features`` alone, no ``segment_ids``/``positions`` (concatenate and chunk
    trained without document masks needs none: two fewer arrays to build and ship a batch)."""

    length: int
    features: tuple[str, ...] = ("tokens",)
    long: PackLong = PackLong.SPLIT
    pad_id: int = 0
    split: PackSplit = PackSplit.DOCUMENTS
    bins: int = 32  # rows open at once in split="documents" (more: less padding, more work per document)
    weights_by: WeightsBy = WeightsBy.DOCUMENTS
    segments: bool = True  # segment_ids and positions in each batch

    def __post_init__(self):
        object.__setattr__(self, "length", _int(self.length, "pack length", 1, MAX_PACK_LENGTH))
        feats = self.features
        if isinstance(feats, str) or not isinstance(feats, Sequence) or not feats:
            raise ConfigError(f"pack features must be a non-empty list of feature names, got {feats!r}")
        if not all(isinstance(f, str) and f for f in feats) or len(set(feats)) != len(feats):
            raise ConfigError(f"pack features must be distinct feature names, got {list(feats)!r}")
        if {"segment_ids", "positions"} & set(feats):
            raise ConfigError("pack features cannot be named segment_ids or positions: packed batches add those")
        object.__setattr__(self, "features", tuple(feats))
        object.__setattr__(self, "long", choice(PackLong, self.long, "pack long"))
        object.__setattr__(self, "split", choice(PackSplit, self.split, "pack split"))
        object.__setattr__(self, "weights_by", choice(WeightsBy, self.weights_by, "pack weights_by"))
        if isinstance(self.pad_id, bool) or not isinstance(self.pad_id, int):
            raise ConfigError(f"pack pad_id must be an integer, got {self.pad_id!r}")
        if not -(1 << 63) <= self.pad_id < 1 << 64:
            raise ConfigError(f"pack pad_id={self.pad_id} fits no integer dtype (-2^63 to 2^64 - 1)")
        object.__setattr__(self, "bins", _int(self.bins, "pack bins", 1))
        if not isinstance(self.segments, bool):
            raise ConfigError(f"pack segments must be True or False, got {self.segments!r}")

    @classmethod
    def of(cls, value) -> Pack:
        """``value`` as a `Pack`: one already, or its fields as a dict (`to_json`'s, the CLI's)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"pack= must be a crossfeed.Pack(length=..., features=...), got {value!r}")
        try:
            return cls(**value)
        except TypeError as e:
            raise ConfigError(f"pack= {dict(value)!r}: {e}") from None

    def to_json(self) -> dict:
        return {
            "length": self.length,
            "features": list(self.features),
            "long": self.long.value,
            "pad_id": self.pad_id,
            "split": self.split.value,
            "bins": self.bins,
            "weights_by": self.weights_by.value,
            "segments": self.segments,
        }


class Remainder(str, enum.Enum):
    PAD = "pad"  # repeat samples from the start of the epoch so every rank gets as many
    DROP = "drop"  # drop the tail; the tail moves with the epoch, so no sample is skipped forever


def choice(cls: type[enum.Enum], value, name: str):
    """``value`` (a member or its value) as a member of ``cls``, or a ConfigError listing the choices."""
    try:
        return cls(value.value if isinstance(value, enum.Enum) else value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"{name}={value!r} is not one of {choices}") from None


def check_seed(seed) -> int:
    """``seed`` as an int >= 0: the plan is a pure function of it, so None (a fresh order each
    time) is refused — by every front end, with this message."""
    if isinstance(seed, bool) or not hasattr(seed, "__index__") or int(seed.__index__()) < 0:
        raise ConfigError(
            f"seed must be a non-negative integer, got {seed!r}; pick one and keep it to reproduce the order"
        )
    return int(seed.__index__())


def _int(value, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}")
    value = int(value.__index__())
    if value < lo:
        raise ConfigError(f"{name} must be an integer >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(
            f"{name}={value:,} is past the most crossfeed allocates for it, {hi:,} (2^{hi.bit_length() - 1})"
        )
    return value


def _image_size(value) -> tuple[int, int] | None:
    """``image_size`` as ``(height, width)``: an int (a square), a pair, or ``"HxW"`` (the CLI's)."""
    if value is None:
        return None
    given = value
    if isinstance(value, str):
        value = value.lower().split("x")
    elif isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    try:
        h, w = (int(v) if not isinstance(v, bool) and float(v) == int(v) else None for v in value)
    except (TypeError, ValueError):
        h = w = None
    if h is None or w is None or h < 1 or w < 1:
        raise ConfigError(f"image_size must be (height, width) of positive integers, or 'HxW', got {given!r}")
    return h, w


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Which samples, in which order: the pure inputs of the epoch plan (`crossfeed.read.stages.sampler`)."""

    batch_size: int
    shuffle: Shuffle = Shuffle.GLOBAL
    seed: int = 0
    drop_last: bool = False
    remainder: Remainder = Remainder.PAD
    block_shards: int = 4
    samples_per_epoch: int | None = None  # a mixture's epoch length (None: the sum of its sources' sizes)
    # token datasets (`crossfeed.read.stages.pack`): batches of packed rows, or of documents under a token budget
    pack: Pack | None = None
    batch_by_tokens: int | None = None  # a rank's batch holds at most this many tokens, padding counted
    # per-sample weights: the name of a weights set of the dataset, or of each source of a mixture (`crossfeed.format.weights`;
    # ``crossfeed.balanced("label")`` names a class-balance set); None: every sample once an epoch
    weights: str | None = None
    skip: Skip | None = None  # global steps and sample ids left out (`crossfeed.read.skips`; a path: a skip file)

    def __post_init__(self):
        if isinstance(self.shuffle, bool):  # shuffle=True/False reads naturally (DataLoader's spelling)
            object.__setattr__(self, "shuffle", Shuffle.GLOBAL if self.shuffle else Shuffle.NONE)
        object.__setattr__(self, "shuffle", choice(Shuffle, self.shuffle, "shuffle"))
        object.__setattr__(self, "remainder", choice(Remainder, self.remainder, "remainder"))
        object.__setattr__(self, "batch_size", _int(self.batch_size, "batch_size", 1, MAX_BATCH_SIZE))
        object.__setattr__(self, "seed", check_seed(self.seed))
        object.__setattr__(self, "block_shards", _int(self.block_shards, "block_shards", 1))
        object.__setattr__(self, "drop_last", bool(self.drop_last))
        skip = Skip.of(self.skip)
        object.__setattr__(self, "skip", skip if skip else None)
        if self.samples_per_epoch is not None:
            object.__setattr__(self, "samples_per_epoch", _int(self.samples_per_epoch, "samples_per_epoch", 1))
        if self.pack is not None:
            object.__setattr__(self, "pack", Pack.of(self.pack))
            if self.batch_size * self.pack.length > MAX_BATCH_TOKENS:
                raise ConfigError(
                    f"batch_size={self.batch_size:,} rows of pack length={self.pack.length:,} tokens is "
                    f"{self.batch_size * self.pack.length:,} tokens a batch, past the most crossfeed allocates, "
                    f"{MAX_BATCH_TOKENS:,} (2^32); lower batch_size or the pack length"
                )
        if self.weights is not None:
            from crossfeed.format.weights import check_weights_name

            object.__setattr__(self, "weights", check_weights_name(self.weights))
            if self.pack is not None or self.batch_by_tokens is not None:
                raise ConfigError("weights= draws samples, not token rows: pass it without pack= or batch_by_tokens=")
        if self.batch_by_tokens is not None:
            object.__setattr__(
                self, "batch_by_tokens", _int(self.batch_by_tokens, "batch_by_tokens", 1, MAX_BATCH_TOKENS)
            )
            if self.pack is not None:
                raise ConfigError(
                    "pass pack= or batch_by_tokens=, not both: packed rows already hold a fixed token count"
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardOptions:
    """Who reads what: this process's rank among ``world_size`` lockstep ranks, and its worker
    among ``num_workers`` (DataLoader workers, processes of a server). ``rank``/``world_size``
    None: from the environment (RANK/WORLD_SIZE as torchrun sets them, else TF_CONFIG, else 0/1),
    resolved when the options are made."""

    # ints once made: None (the default) is resolved from the environment by __post_init__
    rank: int = None  # type: ignore[assignment]
    world_size: int = None  # type: ignore[assignment]
    worker: int = 0
    num_workers: int = 1

    if TYPE_CHECKING:  # the constructor's signature: it also takes None for rank/world_size

        def __init__(
            self, *, rank: int | None = None, world_size: int | None = None, worker: int = 0, num_workers: int = 1
        ) -> None: ...

    def __post_init__(self):
        rank, world = rank_and_world(self.rank, self.world_size)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "world_size", world)
        num = _int(self.num_workers, "num_workers", 1)
        object.__setattr__(self, "num_workers", num)
        worker = _int(self.worker, "worker", 0)
        if worker >= num:
            raise ConfigError(f"worker {worker} is not in range for num_workers {num}")
        object.__setattr__(self, "worker", worker)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """How hard to work. ``num_threads`` batches are built in parallel and at most
    ``num_threads + prefetch`` exist at once, so memory is bounded by batches, not data;
    ``num_threads=0`` builds each batch in the consumer's thread when it asks (no prefetch) —
    what the Loader does anyway for small fixed-layout records without a per-sample transform,
    whose building holds the GIL and costs less than a hand-over to a thread.
    ``on_error="skip"`` drops bad records, counted and logged, up to ``max_skips``.
    ``image_size=(H, W)`` brings every decoded image to that size as it is decoded — ``resize``
    "stretch" (the default: scaled, aspect ratio not kept), "crop" (scaled to cover, centre cut)
    or "pad" (scaled to fit, zero border) — and ``channels`` (1, 3 or 4) converts it (gray to
    RGB, RGBA to RGB …): with both, an image feature is one dense ``(B, H, W, channels)`` uint8
    array per batch whatever the photos' sizes, in every executor and for every shard format.
    ``executor="process"``: ``processes`` worker processes build whole batches (read, decode,
    transform) into shared memory instead — for Python transforms, which threads run one at a
    time; at most ``processes + prefetch`` batches are in flight (see `crossfeed.read.executors.processes`).
    The transforms must then be module-level functions or ``"module:function"`` strings (workers
    import them by reference)."""

    num_threads: int = 2
    prefetch: int = 2
    decode_images: bool = True
    on_error: OnError = OnError.RAISE
    max_skips: int = DEFAULT_MAX_SKIPS  # the write side's default too (crossfeed.policy)
    cache_dir: str | None = None  # remote shards are cached here (default: $CROSSFEED_CACHE_DIR when set)
    cache_limit: int | str | None = None  # bytes, or a size such as "50GB" (None: unbounded)
    executor: ExecutorKind = ExecutorKind.THREAD
    processes: int = 2  # worker processes of executor="process" (not DataLoader's num_workers)
    # where a manifest's data_root outside its dataset may lie (besides $CROSSFEED_ALLOWED_ROOTS)
    allowed_roots: tuple[str, ...] = ()
    # seconds each remote read may take to answer and each piece of it to arrive (None:
    # $CROSSFEED_READ_TIMEOUT, else `crossfeed.io.storage.READ_TIMEOUT`)
    read_timeout: float | None = None
    # fsspec's options for remote datasets (an endpoint, credentials, a region …), given as a
    # dict of JSON values and kept frozen (`FsOptions`); unset ones come from the standard
    # environment and config files (docs/storage.md)
    storage_options: Mapping = FsOptions()
    image_size: tuple[int, int] | None = None  # decoded images brought to (height, width) (None: as stored)
    channels: int | None = None  # decoded images converted to 1, 3 or 4 channels (None: as stored)
    resize: Resize = Resize.STRETCH  # how images reach image_size
    # log the epoch's stage metrics and verdict in one line at INFO at each epoch's end (`Loader.stats`)
    log_stats: bool = False
    # the most a filter (``filter=``, or a transform returning None) may drop, as a share of the
    # samples seen (None: no limit); past it a ConfigError names the filter and the share
    max_filtered: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "allowed_roots", roots.normalise_all(self.allowed_roots))
        if self.read_timeout is not None:
            object.__setattr__(self, "read_timeout", read_deadline(self.read_timeout))
        object.__setattr__(self, "storage_options", FsOptions(self.storage_options))
        object.__setattr__(self, "image_size", _image_size(self.image_size))
        object.__setattr__(self, "resize", choice(Resize, self.resize, "resize"))
        if not isinstance(self.log_stats, bool):
            raise ConfigError(f"log_stats must be True or False, got {self.log_stats!r}")
        if self.channels is not None and (isinstance(self.channels, bool) or self.channels not in (1, 3, 4)):
            raise ConfigError(f"channels must be 1 (gray), 3 (RGB) or 4 (RGBA), got {self.channels!r}")
        if not self.decode_images and (self.image_size is not None or self.channels is not None):
            raise ConfigError("image_size= and channels= act on decoded images; they need decode_images=True")
        object.__setattr__(self, "num_threads", _int(self.num_threads, "num_threads", 0))
        object.__setattr__(self, "executor", choice(ExecutorKind, self.executor, "executor"))
        object.__setattr__(self, "processes", _int(self.processes, "processes", 1))
        object.__setattr__(self, "prefetch", _int(self.prefetch, "prefetch", 0))
        object.__setattr__(self, "on_error", on_error_choice(self.on_error))
        object.__setattr__(self, "max_skips", check_max_skips(self.max_skips))
        mf = self.max_filtered
        if mf is not None and (isinstance(mf, bool) or not isinstance(mf, (int, float)) or not 0 <= mf <= 1):
            raise ConfigError(f"max_filtered must be a share between 0 and 1 (or None: no limit), got {mf!r}")
        if self.cache_dir is None and os.environ.get(CACHE_ENV):
            object.__setattr__(self, "cache_dir", os.environ[CACHE_ENV])
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        if self.cache_limit is not None:
            object.__setattr__(self, "cache_limit", parse_size(self.cache_limit, "cache_limit"))

    @property
    def image_fit(self) -> ImageFit | None:
        """What decoded images are brought to (`ImageFit`), or None: as they are stored."""
        if self.image_size is None and self.channels is None:
            return None
        return ImageFit(self.image_size, self.channels, self.resize.value)


@dataclasses.dataclass(frozen=True)
class Source:
    """One source of a mixture: ``Loader([Source("web/", weight=3), Source("books/")], ...)``.
    ``path``: a dataset (directory, URL or open `Dataset`) of any format the Loader reads
    (TFRecord, WebDataset tar, Parquet); ``weight``: its share of the samples, or a `Schedule` of
    it over the samples consumed (``Schedule.constant([(0, 3), (900_000, 1)])``: docs/read-and-mix.md).

    ``rename``: ``{its name: the mixture's name}`` for features named otherwise in this source
    (``Source("wds/", rename={"jpg": "image", "cls": "label"})``); ``features``: the mixture's
    names of the features to take from it (None: every feature all sources share, renamed).

    ``storage_options``: fsspec's options for this source's URL (``{"endpoint_url": …}``), when
    they differ from the Loader's ``storage_options`` (None: the Loader's).

    A nested mixture: ``path`` a list of `Source` (or a mixture spec file, ``mix.json``) is a group
    of sources weighted ``weight`` as one (`crossfeed.read.sources.nested`: flattened into leaf
    sources when the plan is made); a group takes no split, rename, features or storage_options."""

    path: object
    split: str = "train"
    weight: float | Schedule = 1.0
    rename: tuple[tuple[str, str], ...] = ()  # given as a dict; kept as sorted pairs (hashable)
    features: tuple[str, ...] | None = None
    storage_options: FsOptions | None = None  # given as a dict; kept frozen (`FsOptions`)

    if TYPE_CHECKING:  # the constructor's signature: it takes the dicts and lists __post_init__ freezes

        def __init__(
            self,
            path: object,
            split: str = "train",
            weight: float | Schedule = 1.0,
            rename: Mapping[str, str] | Iterable[tuple[str, str]] = (),
            features: Sequence[str] | None = None,
            storage_options: Mapping | None = None,
        ) -> None: ...

    def __post_init__(self):
        if isinstance(self.path, (list, tuple)):  # a nested mixture: a group of sources weighted as one
            if not self.path or not all(isinstance(c, Source) for c in self.path):
                raise ConfigError(f"a nested mixture's path is a non-empty list of crossfeed.Source, got {self.path!r}")
            if (self.split, self.rename, self.features, self.storage_options) != ("train", (), None, None):
                raise ConfigError("a nested mixture (Source(path=[...])) takes only weight=; give its sources the rest")
            object.__setattr__(self, "path", tuple(self.path))
        if self.storage_options is not None:
            object.__setattr__(self, "storage_options", FsOptions(self.storage_options, where="Source storage_options"))
        if isinstance(self.weight, Mapping):  # a mixture file's {"constant": [[0, 3], ...]}
            object.__setattr__(self, "weight", Schedule.from_json(self.weight, "Source weight"))
        if isinstance(self.weight, Schedule):
            pass
        elif not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool) or not self.weight > 0:
            raise ConfigError(f"Source weight must be a positive number or a crossfeed.Schedule, got {self.weight!r}")
        if not isinstance(self.split, str) or not self.split:
            raise ConfigError(f"Source split must be a split name, got {self.split!r}")
        pairs = self.rename.items() if isinstance(self.rename, Mapping) else self.rename
        try:
            pairs = tuple(sorted((k, v) for k, v in pairs))
        except (TypeError, ValueError):
            raise ConfigError(f"Source rename must map feature names to names, got {self.rename!r}") from None
        if not all(isinstance(n, str) and n for p in pairs for n in p):
            raise ConfigError(f"Source rename must map feature names to names, got {dict(pairs)!r}")
        targets = [v for _, v in pairs]
        if len(set(targets)) != len(targets):
            raise ConfigError(f"Source rename gives two features one name: {dict(pairs)!r}")
        object.__setattr__(self, "rename", pairs)
        if self.features is not None:
            if (
                isinstance(self.features, str)
                or not isinstance(self.features, Sequence)
                or not all(isinstance(n, str) for n in self.features)
            ):
                raise ConfigError(f"Source features must be a list of feature names, got {self.features!r}")
            object.__setattr__(self, "features", tuple(self.features))

    def name_of(self, feature: str) -> str:
        """The mixture's name of this source's ``feature``."""
        return dict(self.rename).get(feature, feature)

    def to_json(self) -> dict:
        """The source as JSON values (a worker process or a mixture file rebuilds it: `from_json`)."""
        features = None if self.features is None else list(self.features)
        if isinstance(self.path, tuple):  # a nested mixture, as a mixture spec file writes it
            weight = self.weight.to_json() if isinstance(self.weight, Schedule) else self.weight
            return {"mixture": [c.to_json() for c in self.path], "weight": weight}
        return {
            # only a path travels as JSON (a worker's recipe never holds an open Dataset)
            "path": os.fspath(cast("str | os.PathLike[str]", self.path)),
            "split": self.split,
            "weight": self.weight.to_json() if isinstance(self.weight, Schedule) else self.weight,
            "rename": dict(self.rename),
            "features": features,
            "storage_options": None if self.storage_options is None else self.storage_options.to_dict(),
        }

    @classmethod
    def from_json(cls, d: dict) -> Source:
        if "mixture" in d:
            return cls([cls.from_json(c) for c in d["mixture"]], weight=d.get("weight", 1.0))
        return cls(
            d["path"],
            d.get("split", "train"),
            d.get("weight", 1.0),
            d.get("rename") or (),
            d.get("features"),
            d.get("storage_options"),
        )


_GROUPS = {"plan": PlanOptions, "shard": ShardOptions, "read": ReadOptions}
# How hard a process works and where it caches: its own, whoever planned the epoch (the servers of
# a dispatcher keep theirs). With its rank and worker, what is not part of a plan shipped to others.
# Which roots a server trusts is its own too: a dispatcher's plan never widens them; and so are
# its credentials and endpoints (storage_options): a dispatcher never ships its secrets; and
# whether it logs its stage metrics (log_stats); and how much its filter may drop (max_filtered: the
# filter is its own, as its transform is).
LOCAL_FIELDS = (
    "num_threads",
    "prefetch",
    "executor",
    "processes",
    "cache_dir",
    "cache_limit",
    "allowed_roots",
    "read_timeout",
    "storage_options",
    "log_stats",
    "max_filtered",
)
_PER_PROCESS = ("rank", "worker", "num_workers")
# Named by the stream's identity, not shipped: a server reads its own skip list (``--skip FILE``:
# 10^7 ids do not fit a message) and refuses a plan whose identity names another one.
_BY_IDENTITY = ("skip",)
_FIELDS = {f.name: group for group, cls in _GROUPS.items() for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """Everything a read pipeline needs besides its source and its Python callables."""

    plan: PlanOptions
    split: str = "train"
    features: tuple[str, ...] | None = None  # None: every feature of the schema
    return_index: bool = False  # batches carry ``__index__``: the global sample indices
    shard: ShardOptions = dataclasses.field(default_factory=ShardOptions)
    read: ReadOptions = ReadOptions()

    def __post_init__(self):
        if not isinstance(self.split, str) or not self.split:
            raise ConfigError(f"split must be a split name, got {self.split!r}")
        if self.features is not None:
            if isinstance(self.features, str) or not isinstance(self.features, Sequence):
                raise ConfigError(f"features must be a list of feature names, got {self.features!r}")
            object.__setattr__(self, "features", tuple(self.features))
        for name, cls in _GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name}= must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")

    @classmethod
    def of(cls, *, batch_size: int, read: ReadOptions | None = None, **fields) -> LoaderOptions:
        """Options from flat keywords: any field of this class or of its groups (``shuffle``,
        ``seed``, ``rank``, ``num_threads``, ``on_error`` …); ``read=`` a whole `ReadOptions`."""
        groups: dict[str, dict] = {g: {} for g in _GROUPS}
        top = {}
        for k, v in fields.items():
            if k in _FIELDS:
                groups[_FIELDS[k]][k] = v
            elif k in ("split", "features", "return_index"):
                top[k] = v
            else:
                raise ConfigError(
                    f"unknown loader option {k}=; the options are {sorted([*_FIELDS, 'split', 'features', 'return_index'])}"
                )
        if read is not None:
            groups["read"] = {**{f.name: getattr(read, f.name) for f in dataclasses.fields(read)}, **groups["read"]}
        groups["plan"]["batch_size"] = batch_size
        return cls(**top, **{g: _GROUPS[g](**kw) for g, kw in groups.items()})

    @classmethod
    def given(cls, options: LoaderOptions | None, fields: dict, *, who: str = "Loader") -> LoaderOptions:
        """The options a constructor was given: ``options`` whole, or ``fields`` as keywords for
        `of` — not both (the one check every layer that takes options makes)."""
        if options is None:
            if fields.get("batch_size") is None:
                raise ConfigError(f"{who} needs batch_size= (or a LoaderOptions)")
            return cls.of(**fields)
        if fields:
            raise ConfigError(f"pass either a LoaderOptions or keywords, not both (got {sorted(fields)})")
        if not isinstance(options, cls):
            raise ConfigError(f"options must be a LoaderOptions, got {type(options).__name__}")
        return options

    def replace(self, **changes) -> LoaderOptions:
        """A copy with fields changed by name, whichever group holds them (validated again)."""
        top = {k: v for k, v in changes.items() if k not in _FIELDS}
        for group in _GROUPS:
            sub = {k: v for k, v in changes.items() if _FIELDS.get(k) == group}
            if sub:
                top[group] = dataclasses.replace(getattr(self, group), **sub)
        try:
            return dataclasses.replace(self, **top)
        except TypeError as e:
            raise ConfigError(f"unknown loader option in {sorted(changes)}: {e}") from None

    def flat(self) -> dict:
        """Every field by name as plain JSON values (choices by their value, paths as strings):
        ``LoaderOptions.of(**options.flat()) == options``."""
        out = {}
        for group in _GROUPS:
            for f in dataclasses.fields(getattr(self, group)):
                v = getattr(getattr(self, group), f.name)
                out[f.name] = (
                    v.value
                    if isinstance(v, enum.Enum)
                    else v.to_dict()
                    if isinstance(v, FsOptions)
                    else v.to_json()
                    if isinstance(v, (Pack, Skip))
                    else os.fspath(v)
                    if isinstance(v, os.PathLike)
                    else list(v)
                    if isinstance(v, tuple)
                    else v
                )
        features = None if self.features is None else list(self.features)
        return {**out, "split": self.split, "features": features, "return_index": self.return_index}

    def plan_fields(self) -> dict:
        """`flat` less what each process decides for itself (`LOCAL_FIELDS`, its rank and worker)
        and the skip list (each server's own, checked by the stream's identity): the plan a
        dispatcher ships to every server, as JSON values."""
        return {k: v for k, v in self.flat().items() if k not in {*LOCAL_FIELDS, *_PER_PROCESS, *_BY_IDENTITY}}

    @classmethod
    def from_plan(cls, plan, local: LoaderOptions) -> LoaderOptions:
        """The options a server builds a shipped ``plan`` (`plan_fields`) with: the plan's fields,
        validated as any options are, and ``local``'s `LOCAL_FIELDS` and skip list (the identity
        the dispatcher sends names its own: a server checks that they agree); rank 0 of the plan's
        world size (a dispatcher picks each batch's rank)."""
        if not isinstance(plan, dict) or not all(isinstance(k, str) for k in plan):
            raise ConfigError(f"a plan is an object of option fields, got {type(plan).__name__}")
        mine = sorted(set(plan) & {*LOCAL_FIELDS, *_PER_PROCESS, *_BY_IDENTITY})
        if mine:
            raise ConfigError(f"a plan does not carry {mine}: each process sets those itself")
        if "batch_size" not in plan:
            raise ConfigError("a plan must carry batch_size")
        return cls.of(**plan, rank=0, skip=local.plan.skip, **{k: getattr(local.read, k) for k in LOCAL_FIELDS})

    # the most used fields, flat
    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world_size(self) -> int:
        return self.shard.world_size
