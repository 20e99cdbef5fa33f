"""Control messages of the data plane: one fixed 40-byte envelope frame, then a payload.

    envelope: magic "CXFN" | u8 version | u8 kind | u16 reserved | i64 a | i64 b
              | u64 instance | u64 token

`instance` is the sending server's random instance id (fresh in every server process, in every
message it sends; 0 from clients): a client that hears a new instance at an address knows the
server restarted and never merges the two streams. `token` is a client's lease probe (below).

client → server: CREDIT(a=batches allowed in flight, b=bytes allowed in flight, 0: any),
                 ACK(a=seq), HEARTBEAT(a=credit, b=byte credit, token=probe or 0), BYE,
                 ACKS(a=count; payload = one frame of `count` int64 seqs, at most MAX_ACKS)
server → client: BATCH(a=seq, b=epoch; payload = `crossfeed.format.wire` frames),
                 END_OF_EPOCH(a=epoch, b=batches in it), END_OF_STREAM(a=epochs served),
                 HEARTBEAT(a=silence timeout ms, b=progress deadline ms (0: none), token=0), or,
                 answering a probe, token=the probe and b=ms left before that trainer's deadline,
                 FENCED(token=probe answered or 0): the server declared this client dead and gave
                 its unacknowledged batches to others; nothing it holds may be used

`recv_bounded` reads a multipart message frame by frame and drops it (draining the rest)
once it passes the frame or byte limit, so a hostile peer cannot make us hold more.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import struct
import time
from typing import Any

import zmq

from crossfeed.errors import ConfigError, WireError

MAGIC = b"CXFN"
VERSION = 3  # 2: ACKS, several acknowledgements in one message; 3: instance, token, FENCED
_ENVELOPE = struct.Struct("<4sBBHqqQQ")
ENVELOPE_SIZE = _ENVELOPE.size
MAX_ACKS = 256  # seqs per ACKS message: 8 * 256 bytes stays far below the server's 4 KiB limit
_SEQS = struct.Struct("<q")


class Kind(enum.IntEnum):
    CREDIT = 1
    ACK = 2
    HEARTBEAT = 3
    BYE = 4
    ACKS = 5
    BATCH = 16
    END_OF_EPOCH = 17
    END_OF_STREAM = 18
    FENCED = 19


CLIENT_KINDS = frozenset({Kind.CREDIT, Kind.ACK, Kind.ACKS, Kind.HEARTBEAT, Kind.BYE})
SERVER_KINDS = frozenset({Kind.BATCH, Kind.END_OF_EPOCH, Kind.END_OF_STREAM, Kind.HEARTBEAT, Kind.FENCED})


@dataclasses.dataclass(frozen=True)
class Envelope:
    kind: Kind
    a: int = 0
    b: int = 0
    instance: int = 0
    token: int = 0


def pack(kind: Kind, a: int = 0, b: int = 0, *, instance: int = 0, token: int = 0) -> bytes:
    return _ENVELOPE.pack(MAGIC, VERSION, int(kind), 0, a, b, instance, token)


def new_instance() -> int:
    """A random, non-zero 64-bit id for one server process (or one client lease probe)."""
    return int.from_bytes(os.urandom(8), "little") | 1


def pack_acks(seqs: list[int]) -> list[bytes]:
    """The frames of one ACKS message acknowledging `seqs` (1..MAX_ACKS of them)."""
    if not 1 <= len(seqs) <= MAX_ACKS:
        raise ValueError(f"an ACKS message carries 1..{MAX_ACKS} seqs, got {len(seqs)}")
    return [pack(Kind.ACKS, len(seqs)), struct.pack(f"<{len(seqs)}q", *seqs)]


def unpack_acks(env: Envelope, payload: Any) -> tuple[int, ...]:
    """The seqs an ACKS envelope and its payload frame acknowledge; WireError if they disagree."""
    data = getattr(payload, "buffer", payload)
    if not 1 <= env.a <= MAX_ACKS or len(data) != env.a * _SEQS.size:
        raise WireError(
            f"ACKS declares {env.a} seqs (1..{MAX_ACKS}) in a payload of {len(data)} bytes, "
            f"expected {env.a * _SEQS.size}"
        )
    return struct.unpack(f"<{env.a}q", data)


_KINDS = {int(k): k for k in Kind}


def unpack(frame: Any, allowed: frozenset[Kind]) -> Envelope:
    """The envelope in `frame`; WireError unless it is well formed and of an allowed kind."""
    data = getattr(frame, "buffer", frame)
    if len(data) != ENVELOPE_SIZE:
        raise WireError(f"envelope has {len(data)} bytes, expected {ENVELOPE_SIZE}")
    magic, version, kind, _reserved, a, b, instance, token = _ENVELOPE.unpack(data)
    if magic != MAGIC:
        raise WireError(f"bad envelope magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"protocol version {version} not supported (this side speaks {VERSION})")
    k = _KINDS.get(kind)
    if k is None:
        raise WireError(f"unknown message kind {kind}")
    if k not in allowed:
        raise WireError(f"message kind {k.name} not expected here")
    return Envelope(k, a, b, instance, token)


def recv_bounded(sock: zmq.Socket, max_frames: int, max_bytes: int) -> list[zmq.Frame]:
    """One whole multipart message (non-blocking: call after poll said readable).

    Raises WireError after draining the message if it has more than `max_frames` frames or
    `max_bytes` bytes; the socket is then ready for the next message.
    """
    frames: list[zmq.Frame] = []
    size = 0
    error = None
    while True:
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        if error is None:
            size += len(frame)
            if len(frames) >= max_frames or size > max_bytes:
                error = f"message over the limit ({max_frames} frames / {max_bytes} bytes), dropped"
                frames.clear()
            else:
                frames.append(frame)
        if not frame.more:
            break
    if error is not None:
        raise WireError(error)
    return frames


class RateLimitedLog:
    """Logs at most `burst` messages per `interval` seconds per key; counts the ones it holds
    back and says how many with the next one it logs."""

    def __init__(self, logger: logging.Logger, interval: float = 5.0, burst: int = 1):
        self._logger, self._interval, self._burst = logger, interval, burst
        self._window: dict[str, tuple[float, int]] = {}  # key -> (its window's start, messages logged in it)
        self._held: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def log(self, level: int, key: str, msg: str, *args: Any, **kwargs: Any) -> None:
        now = time.monotonic()
        start, logged = self._window.get(key, (-1e18, 0))
        if now - start >= self._interval:
            start, logged = now, 0
        if logged >= self._burst:
            self._held[key] = self._held.get(key, 0) + 1
            return
        self._window[key] = (start, logged + 1)
        held = self._held.pop(key, 0)
        suffix = f" ({held} similar messages suppressed)" if held else ""
        self._logger.log(level, msg + suffix, *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """Both sides send a HEARTBEAT every `interval` s; a peer silent for `timeout` s is dead."""

    interval: float = 1.0
    timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("interval", "timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ConfigError(f"heartbeat {name} must be a number of seconds, got {value!r}")
        if not 0 < self.interval < self.timeout:
            raise ConfigError(
                f"heartbeat interval ({self.interval}) must be > 0 and below the timeout ({self.timeout})"
            )


def bind_address(address: str) -> str:
    """tcp port 0 means "any free port" (ZeroMQ spells it `*`)."""
    if address.startswith("tcp://") and address.endswith(":0"):
        return address[:-2] + ":*"
    return address
