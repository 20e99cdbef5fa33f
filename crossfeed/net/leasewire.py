"""Messages between the dispatcher and its servers and trainers: a fixed envelope, then at most
one payload frame (an int64 array or UTF-8 text), every field checked on arrival.

    envelope: magic "CXFD" | u8 version | u8 kind | u16 reserved | i64 a | i64 b | i64 c
              | u64 sender | u64 instance

`sender` is the random id of the server or trainer (0 from the dispatcher), `instance` the
dispatcher process's random id (0 from others): a new one means the dispatcher restarted.

server → dispatcher: HELLO(payload = its data endpoints, text), BEAT, BYE (hands its leases back)
dispatcher → server: WELCOME(a=batches per epoch; payload = the plan as JSON text),
                     LEASE(a=lease id, b=epoch, c=batches per epoch; payload = batch numbers),
                     RESET (you were declared dead or are unknown: drop your leases, say HELLO
                     under a new id), FINISHED (every epoch is done)
trainer → dispatcher: BEAT, CLAIM(payload = seq, lease pairs), DONE(payload = seqs), BYE
dispatcher → trainer: SERVERS(a=finished, b=silence timeout ms; payload = endpoints, text),
                      GRANTS(payload = seq, lease, granted triples),
                      DONE_OK(a=finished; payload = seqs),
                      RESET (you were declared dead: drop what you were granted and not used)
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Any

import numpy as np

from crossfeed.errors import WireError

MAGIC = b"CXFD"
VERSION = 1
_ENVELOPE = struct.Struct("<4sBBHqqqQQ")
ENVELOPE_SIZE = _ENVELOPE.size
MAX_ITEMS = 1024  # int64 values in one payload
MAX_TEXT = 65536  # bytes of text in one payload
MAX_MESSAGE = ENVELOPE_SIZE + max(MAX_ITEMS * 24, MAX_TEXT)


class Kind(enum.IntEnum):
    HELLO = 1
    BEAT = 2
    BYE = 3
    CLAIM = 4
    DONE = 5
    WELCOME = 16
    LEASE = 17
    RESET = 18
    FINISHED = 19
    SERVERS = 20
    GRANTS = 21
    DONE_OK = 22


SERVER_KINDS = frozenset({Kind.HELLO, Kind.BEAT, Kind.BYE})
TRAINER_KINDS = frozenset({Kind.BEAT, Kind.CLAIM, Kind.DONE, Kind.BYE})
TO_SERVER = frozenset({Kind.WELCOME, Kind.LEASE, Kind.RESET, Kind.FINISHED})
TO_TRAINER = frozenset({Kind.SERVERS, Kind.GRANTS, Kind.DONE_OK, Kind.RESET})
_TEXT = frozenset({Kind.HELLO, Kind.WELCOME, Kind.SERVERS})
_INTS = frozenset({Kind.LEASE, Kind.CLAIM, Kind.DONE, Kind.GRANTS, Kind.DONE_OK})
_WIDTH = {Kind.CLAIM: 2, Kind.GRANTS: 3}  # int64s per item (others: 1)
_KINDS = {int(k): k for k in Kind}


@dataclasses.dataclass(frozen=True)
class Message:
    kind: Kind
    a: int = 0
    b: int = 0
    c: int = 0
    sender: int = 0
    instance: int = 0
    payload: Any = None  # np.ndarray[int64] for integer kinds, str for text kinds, else None


def pack(kind: Kind, a: int = 0, b: int = 0, c: int = 0, *, sender: int = 0, instance: int = 0, payload=None) -> list:
    frames: list = [_ENVELOPE.pack(MAGIC, VERSION, int(kind), 0, a, b, c, sender, instance)]
    if kind in _TEXT:
        frames.append((payload or "").encode())
    elif kind in _INTS:
        frames.append(np.ascontiguousarray(payload if payload is not None else [], dtype="<i8").tobytes())
    return frames


def unpack(frames: list, allowed: frozenset[Kind]) -> Message:
    """The message in `frames` (the envelope, then its payload if its kind has one)."""
    if not frames:
        raise WireError("empty message")
    data = getattr(frames[0], "bytes", frames[0])
    if len(data) != ENVELOPE_SIZE:
        raise WireError(f"dispatcher envelope has {len(data)} bytes, expected {ENVELOPE_SIZE}")
    magic, version, kind, _r, a, b, c, sender, instance = _ENVELOPE.unpack(data)
    if magic != MAGIC:
        raise WireError(f"bad dispatcher envelope magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"dispatcher protocol version {version} not supported (this side speaks {VERSION})")
    k = _KINDS.get(kind)
    if k is None or k not in allowed:
        raise WireError(f"message kind {kind} not expected here")
    want = 2 if k in _TEXT or k in _INTS else 1
    if len(frames) != want:
        raise WireError(f"{k.name} has {len(frames)} frames, expected {want}")
    payload = None
    if want == 2:
        raw = getattr(frames[1], "bytes", frames[1])
        if k in _TEXT:
            if len(raw) > MAX_TEXT:
                raise WireError(f"{k.name} text of {len(raw)} bytes (at most {MAX_TEXT})")
            try:
                payload = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise WireError(f"{k.name} text is not UTF-8: {e}") from e
        else:
            width = _WIDTH.get(k, 1)
            if len(raw) % (8 * width) or len(raw) > MAX_ITEMS * 8 * width:
                raise WireError(
                    f"{k.name} payload of {len(raw)} bytes is not whole {8 * width}-byte items (<= {MAX_ITEMS} items)"
                )
            payload = np.frombuffer(raw, dtype="<i8")
            if width > 1:
                payload = payload.reshape(-1, width)
    return Message(k, a, b, c, sender, instance, payload)


def endpoints(text: str) -> list[str]:
    """The data endpoints a server announces: tcp:// or ipc:// addresses, space separated."""
    out = text.split()
    if not out or len(out) > 16:
        raise WireError(f"a server announces 1..16 endpoints, got {len(out)}")
    for a in out:
        if not a.startswith(("tcp://", "ipc://")) or len(a) > 256 or not a.isprintable():
            raise WireError(f"bad endpoint {a[:80]!r} (expected tcp://HOST:PORT or ipc://PATH)")
    return out
