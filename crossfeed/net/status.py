"""What a server or a dispatcher says about itself: `crossfeed top`'s query, and the Loader's stats.

One request, one answer, on the socket trainers and servers already use (a server's ROUTER,
the dispatcher's ROUTER), in a tiny protocol of its own that neither data protocol mistakes
for one of its messages:

    request: one frame, magic "CXFS" | u8 version | u8 kind=1 | u16 reserved | u64 request id
    answer:  that envelope with kind=2 and the same id, then one frame of UTF-8 JSON
             (at most MAX_STATUS bytes): {"v": 1, "kind": "server" | "dispatcher", ...}

The answering side builds the JSON (`Server.status()`, `LeaseDispatcher.status()`) and answers
at most RATE requests a second (`StatusGate`), so a flood of requests costs it nothing but the
reads. The asking side (`query`) trusts nothing: the answer is bounded before it is read, and
`ServerStatus.parse` / `DispatcherStatus.parse` check every field's type and range (a peer is
untrusted) and raise `WireError` naming the field.

Who may ask: anyone who may connect to that socket (with CURVE, holders of an accepted key). The
answer holds counters, ids, addresses and ages, nothing of the data.

`loader_stats(loader)` is the one place that reads a Loader's per-stage timing (`Loader.stats()`,
when the Loader has it); `split_stats` names its flat keys for `top` and the Prometheus exporter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
import time
from collections.abc import Mapping
from typing import Any

import zmq

from crossfeed.errors import CrossfeedError, WireError
from crossfeed.net.keys import ClientKeys, secure_client_socket

MAGIC = b"CXFS"
VERSION = 1
REQUEST, ANSWER = 1, 2
_ENVELOPE = struct.Struct("<4sBBHQ")
ENVELOPE_SIZE = _ENVELOPE.size
MAX_STATUS = 60000  # bytes of JSON in one answer
MAX_LISTED = 100  # servers and trainers listed in a dispatcher's answer (the totals count them all)
MAX_STATS = 64  # entries of a Loader's flat stats in a server's answer
RATE = 20.0  # answers a second, at most, per server or dispatcher
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_HEX_ID = re.compile(r"[0-9a-f]{16}")


def is_status(frame: Any) -> bool:
    """Whether `frame` (bytes or a zmq.Frame) is shaped like a status envelope (checked in full
    by `request_id` and `query`); no data message starts with its magic."""
    data = getattr(frame, "bytes", frame)
    return len(data) == ENVELOPE_SIZE and data[:4] == MAGIC


def pack_request(request_id: int) -> bytes:
    return _ENVELOPE.pack(MAGIC, VERSION, REQUEST, 0, request_id)


def request_id(frames: list) -> int:
    """The id of the status request in `frames`; WireError unless it is exactly one."""
    if len(frames) != 1:
        raise WireError(f"a status request is one frame, got {len(frames)}")
    return _unpack(frames[0], REQUEST)


def pack_answer(rid: int, status: Mapping[str, Any]) -> list[bytes]:
    """The frames answering request `rid` with `status`, within MAX_STATUS bytes: a dispatcher's
    answer too long for it lists fewer servers, then fewer trainers (the last ones of its lists;
    ``servers_total`` and ``trainers_total`` still count them all, so `top` says how many are not
    shown). What its peers registered decides the length, so it is never an error; anything else
    too long is a bug of the answering side (ValueError)."""
    text = _json(status)
    if len(text) > MAX_STATUS and isinstance(status.get("servers"), list):
        status = {**status, "servers": list(status["servers"]), "trainers": list(status.get("trainers", []))}
        over = len(text) - MAX_STATUS
        for key in ("servers", "trainers"):
            entries = status[key]
            while over > 0 and entries:
                over -= len(_json(entries.pop())) + 1  # the entry and its comma
        text = _json(status)
    if len(text) > MAX_STATUS:
        raise ValueError(f"a status answer of {len(text)} bytes exceeds {MAX_STATUS}")
    return [_ENVELOPE.pack(MAGIC, VERSION, ANSWER, 0, rid), text]


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _unpack(frame: Any, kind: int) -> int:
    data = getattr(frame, "bytes", frame)
    if len(data) != ENVELOPE_SIZE:
        raise WireError(f"status envelope has {len(data)} bytes, expected {ENVELOPE_SIZE}")
    magic, version, k, reserved, rid = _ENVELOPE.unpack(data)
    if magic != MAGIC or version != VERSION:
        raise WireError(f"status envelope magic {magic!r} version {version}, expected {MAGIC!r} version {VERSION}")
    if k != kind or reserved:
        raise WireError(f"status envelope of kind {k} (reserved {reserved}), expected kind {kind}")
    return rid


class StatusGate:
    """At most `rate` answers a second (a token bucket of one second's worth); `allow(now)`."""

    def __init__(self, rate: float = RATE):
        self.rate, self._tokens, self._at = rate, rate, 0.0
        self.refused = 0

    def allow(self, now: float) -> bool:
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.refused += 1
        return False


def query(address: str, *, keys: ClientKeys | None = None, timeout: float = 2.0) -> dict[str, Any]:
    """The status JSON object of the server or dispatcher at `address` (checked only as far as
    {"v": 1, "kind": ...}; `parse_status` checks the rest). CrossfeedError if none comes in time."""
    import secrets

    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_STATUS + ENVELOPE_SIZE)
    secure_client_socket(sock, keys)
    rid = secrets.randbits(63) + 1
    try:
        sock.connect(address)
        sock.send(pack_request(rid), zmq.NOBLOCK)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                continue
            frames = _recv_bounded(sock)
            if frames is None or len(frames) != 2 or not is_status(frames[0]):
                continue  # not a status answer (a data message, or one over the limit): skip it
            if _unpack(frames[0], ANSWER) != rid:
                continue
            return _object(frames[1])
    except zmq.ZMQError as e:
        raise CrossfeedError(f"cannot ask {address} for its status: {e}") from e
    finally:
        sock.close(linger=0)
    raise CrossfeedError(
        f"no status from {address} within {timeout:g}s: name the address trainers use (a `crossfeed dispatch` "
        "address, or a distribution address of `crossfeed serve`, not a broadcast one), check that it runs "
        "this crossfeed version or later, and pass --keys if it uses CURVE"
    )


def _recv_bounded(sock: zmq.Socket) -> list[bytes] | None:
    frames: list[bytes] = []
    size, over = 0, False
    while True:
        frame = sock.recv(zmq.NOBLOCK)
        size += len(frame)
        over = over or len(frames) >= 2 or size > MAX_STATUS + ENVELOPE_SIZE
        if not over:
            frames.append(frame)
        if not sock.getsockopt(zmq.RCVMORE):
            return None if over else frames


def _reject(value: str) -> None:
    raise ValueError(f"{value} is not a number")


def _object(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_reject)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(f"status answer is not JSON: {e}") from e
    if not isinstance(obj, dict) or obj.get("v") != 1 or obj.get("kind") not in ("server", "dispatcher"):
        raise WireError('status answer is not {"v": 1, "kind": "server" | "dispatcher", ...}')
    return obj


# ---- checking what a peer said ----
def _field(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise WireError(f"{where}: no field {key!r}")
    value = obj[key]
    if isinstance(value, bool) and kind is not bool:
        raise WireError(f"{where}: {key} is {value!r}, not a number")
    if not isinstance(value, kind):
        raise WireError(f"{where}: {key} is {type(value).__name__}, expected {kind}")
    return value


def _count(obj: Mapping[str, Any], key: str, where: str) -> int:
    value = _field(obj, key, int, where)
    if not 0 <= value < 1 << 63:
        raise WireError(f"{where}: {key} {value} is outside 0..2**63-1")
    return value


def _seconds(obj: Mapping[str, Any], key: str, where: str) -> float:
    value = float(_field(obj, key, (int, float), where))
    if not (math.isfinite(value) and 0 <= value < 1e12):
        raise WireError(f"{where}: {key} {value} is not a duration in seconds")
    return value


def _share(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    """A share in [0, 1], or None for null (or for no field: an older peer does not send it)."""
    value = obj.get(key)
    if value is None:
        return None
    value = float(_field(obj, key, (int, float), where))
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise WireError(f"{where}: {key} {value} is not a share in [0, 1]")
    return value


def _rate_field(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    """Batches per second (finite, >= 0), or None for null or no field (an older peer)."""
    value = obj.get(key)
    if value is None:
        return None
    value = float(_field(obj, key, (int, float), where))
    if not (math.isfinite(value) and 0 <= value < 1e12):
        raise WireError(f"{where}: {key} {value} is not a rate in batches per second")
    return value


def _text(obj: Mapping[str, Any], key: str, where: str, limit: int = 256) -> str:
    value = _field(obj, key, str, where)
    if len(value) > limit or not value.isprintable():
        raise WireError(f"{where}: {key} is not printable text of at most {limit} characters")
    return value


def _list(obj: Mapping[str, Any], key: str, where: str) -> list:
    value = _field(obj, key, list, where)
    if len(value) > MAX_LISTED or not all(isinstance(x, dict) for x in value):
        raise WireError(f"{where}: {key} is not a list of at most {MAX_LISTED} objects")
    return value


def _stats(value: Any, where: str) -> dict[str, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_STATS:
        raise WireError(f"{where}: loader stats are not an object of at most {MAX_STATS} entries")
    out = {}
    for k, v in value.items():
        if not _NAME.fullmatch(k) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise WireError(f"{where}: loader stat {k[:64]!r} is not a name with a number")
        if not math.isfinite(v) or not 0 <= v < 1e18:
            raise WireError(f"{where}: loader stat {k} {v} is out of range")
        out[k] = float(v)
    return out


@dataclasses.dataclass(frozen=True)
class ServerStatus:
    """What `crossfeed serve` says of itself (`Server.status()`)."""

    server_id: str
    uptime: float  # seconds since it started
    delivered: int  # batches acknowledged by a trainer
    samples: int  # their samples
    nbytes: int  # their payload bytes
    sent: int  # batch sends (re-sends of a dead trainer's batches included)
    epochs: int
    trainers: int  # live trainers
    fenced: int  # trainers declared dead or stalled
    dropped_messages: int
    dispatched: bool  # builds a dispatcher's leases
    loader: dict[str, float] | None  # `loader_stats`, while the Loader reports them

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> ServerStatus:
        w = "server status"
        if obj.get("kind") != "server":
            raise WireError(f"{w}: kind is {obj.get('kind')!r}, expected 'server'")
        return cls(
            server_id=_text(obj, "server_id", w),
            uptime=_seconds(obj, "uptime", w),
            delivered=_count(obj, "delivered", w),
            samples=_count(obj, "samples", w),
            nbytes=_count(obj, "bytes", w),
            sent=_count(obj, "sent", w),
            epochs=_count(obj, "epochs", w),
            trainers=_count(obj, "trainers", w),
            fenced=_count(obj, "fenced", w),
            dropped_messages=_count(obj, "dropped_messages", w),
            dispatched=_field(obj, "dispatched", bool, w),
            loader=_stats(obj.get("loader"), w),
        )


@dataclasses.dataclass(frozen=True)
class ServerEntry:
    """One live server as the dispatcher sees it."""

    id: str  # the dispatcher's 16-hex-digit id of it
    address: str  # its data endpoints, space separated
    age: float  # seconds since its last heartbeat
    leases: int  # live leases it holds
    leased: int  # batches leased to it and not yet claimed
    claimed: int  # of its batches, claimed by trainers (while it lives)
    # its batches claimed per second over the last seconds (`LeaseBook.rate`; None: none yet, or an
    # older dispatcher) and that rate's share of all live servers' (None: no rates yet)
    rate: float | None = None
    share: float | None = None


@dataclasses.dataclass(frozen=True)
class TrainerEntry:
    """One live trainer as the dispatcher sees it."""

    id: str
    age: float  # seconds since its last heartbeat
    claimed: int  # batches it claimed this epoch
    holding: int  # claimed and not yet reported used
    wait: float | None = None  # its training loop's last reported share of time waiting for input
    wait_age: float | None = None  # seconds since it reported that (None: it never did)


@dataclasses.dataclass(frozen=True)
class DispatcherStatus:
    """What `crossfeed dispatch` says of itself (`LeaseDispatcher.status()`)."""

    uptime: float
    epoch: int
    epochs: int | None
    batches: int  # per epoch
    finished: bool
    progress: dict[str, int]  # pending, leased, claimed, done batches of the epoch
    counters: dict[str, int]  # see COUNTERS
    servers: tuple[ServerEntry, ...]
    servers_total: int
    trainers: tuple[TrainerEntry, ...]
    trainers_total: int

    STATES = ("pending", "leased", "claimed", "done")
    COUNTERS = (
        "leases",  # leases granted
        "granted",  # claims granted
        "refused",  # claims refused
        "leases_revoked",  # leases revoked (their server died, stalled or left, or overtaken)
        "batches_re_leased",  # their unclaimed batches, leased again
        "servers_lost",  # declared dead or stalled
        "trainers_lost",
        "dropped_messages",  # malformed
    )
    # counters an older dispatcher does not send (0 then)
    NEWER_COUNTERS = ("batches_taken_over",)  # leased batches moved from a slow or stalled server to a faster one

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> DispatcherStatus:
        w = "dispatcher status"
        if obj.get("kind") != "dispatcher":
            raise WireError(f"{w}: kind is {obj.get('kind')!r}, expected 'dispatcher'")
        progress = _field(obj, "progress", dict, w)
        counters = _field(obj, "counters", dict, w)
        epochs = obj.get("epochs")
        servers = []
        for s in _list(obj, "servers", w):
            sid = _text(s, "id", "dispatcher status: a server")
            if not _HEX_ID.fullmatch(sid):
                raise WireError(f"{w}: server id {sid[:20]!r} is not 16 hex digits")
            servers.append(
                ServerEntry(
                    sid,
                    _text(s, "address", f"{w}: server {sid}", limit=8 * 257),
                    _seconds(s, "age", f"{w}: server {sid}"),
                    _count(s, "leases", f"{w}: server {sid}"),
                    _count(s, "leased", f"{w}: server {sid}"),
                    _count(s, "claimed", f"{w}: server {sid}"),
                    _rate_field(s, "rate", f"{w}: server {sid}"),
                    _share(s, "share", f"{w}: server {sid}"),
                )
            )
        trainers = []
        for t in _list(obj, "trainers", w):
            tid = _text(t, "id", "dispatcher status: a trainer")
            if not _HEX_ID.fullmatch(tid):
                raise WireError(f"{w}: trainer id {tid[:20]!r} is not 16 hex digits")
            wait = _share(t, "wait", f"{w}: trainer {tid}")
            if wait is None and t.get("wait_age") is not None:
                raise WireError(f"{w}: trainer {tid} has a wait_age and no wait")
            trainers.append(
                TrainerEntry(
                    tid,
                    _seconds(t, "age", f"{w}: trainer {tid}"),
                    _count(t, "claimed", f"{w}: trainer {tid}"),
                    _count(t, "holding", f"{w}: trainer {tid}"),
                    wait,
                    None if wait is None else _seconds(t, "wait_age", f"{w}: trainer {tid}"),
                )
            )
        return cls(
            uptime=_seconds(obj, "uptime", w),
            epoch=_count(obj, "epoch", w),
            epochs=None if epochs is None else _count(obj, "epochs", w),
            batches=_count(obj, "batches", w),
            finished=_field(obj, "finished", bool, w),
            progress={k: _count(progress, k, f"{w}: progress") for k in cls.STATES},
            counters={k: _count(counters, k, f"{w}: counters") for k in cls.COUNTERS}
            | {k: _count(counters, k, f"{w}: counters") if k in counters else 0 for k in cls.NEWER_COUNTERS},
            servers=tuple(servers),
            servers_total=_count(obj, "servers_total", w),
            trainers=tuple(trainers),
            trainers_total=_count(obj, "trainers_total", w),
        )


def parse_status(obj: Mapping[str, Any]) -> ServerStatus | DispatcherStatus:
    return ServerStatus.parse(obj) if obj.get("kind") == "server" else DispatcherStatus.parse(obj)


# ---- a Loader's per-stage timing ----
def loader_stats(loader: Any) -> dict[str, float] | None:
    """The Loader's flat stats (`Loader.stats().as_dict()`: stage seconds and counts, the
    consumer's wait, cache hits/misses/bytes), numbers only and at most MAX_STATS of them; None
    while the Loader does not report them (no `stats`), or for no Loader. The one wiring point
    of stage metrics: `top`, the servers' status and the Prometheus exporter all read it here."""
    stats = getattr(loader, "stats", None)
    if not callable(stats):
        return None
    flat = stats().as_dict()
    out: dict[str, float] = {}
    for k, v in flat.items():
        if len(out) >= MAX_STATS:
            break
        if isinstance(k, str) and _NAME.fullmatch(k) and isinstance(v, (int, float)) and not isinstance(v, bool):
            if math.isfinite(v) and v >= 0:
                out[k] = float(v)
    return out


@dataclasses.dataclass(frozen=True)
class Split:
    """A Loader's flat stats by meaning: seconds per stage, the consumer's wait, the cache's counts."""

    stages: dict[str, float]  # "<stage>_seconds" -> {stage: seconds}
    wait: float | None  # "wait_seconds"
    cache: dict[str, float]  # "cache_hits", "cache_misses", "cache_bytes" -> {hits, misses, bytes}


def split_stats(flat: Mapping[str, float]) -> Split:
    """Name the flat keys (`crossfeed.read.metrics.Stats.as_dict`): ``wait_seconds`` is the
    consumer's wait, ``cache_<what>`` the cache's counts, ``stage_<stage>_seconds`` the seconds a
    stage took; the rest (counts, ``consumer_seconds``, ``elapsed_seconds``) is not shown."""
    stages, cache = {}, {}
    wait = None
    for k, v in flat.items():
        if k == "wait_seconds":
            wait = v
        elif k.startswith("cache_") and k[6:] in ("hits", "misses", "bytes"):
            cache[k[6:]] = v
        elif k.startswith("stage_") and k.endswith("_seconds") and len(k) > 14:
            stages[k[6:-8]] = v
    return Split(stages, wait, cache)


def loader_verdict(flat: Mapping[str, float] | None, before: Mapping[str, float] | None = None) -> str | None:
    """The verdict (`crossfeed.read.metrics.Verdict`, as its sentence) of a Loader's flat stats
    over the interval since ``before`` (an earlier answer of the same Loader; None: its whole
    life); None without stats or before a batch was delivered. For a server the consumer is its
    producer thread: "input-bound" there means the server's own Loader is what its trainers wait on."""
    if flat is None:
        return None
    now = _stats_of(flat)
    if before is not None:
        now = now.since(_stats_of(before))
    return str(now.verdict()) if now.batches else None


def _stats_of(flat: Mapping[str, float]):
    """The `crossfeed.read.metrics.Stats` whose ``as_dict()`` gave ``flat`` (keys it lacks: 0)."""
    from crossfeed.read.metrics import STAGES, StageStat, Stats

    fields: dict[str, Any] = {
        f.name: type(f.default)(flat.get(f.name, 0))
        for f in dataclasses.fields(Stats)
        if f.name != "stages" and isinstance(f.default, (int, float))
    }
    stages = {
        s: StageStat(float(flat.get(f"stage_{s}_seconds", 0.0)), int(flat.get(f"stage_{s}_count", 0))) for s in STAGES
    }
    return Stats(**fields, stages=stages)
