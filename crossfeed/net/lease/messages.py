"""Messages between the dispatcher and its servers and trainers: a fixed envelope, then at most
one payload frame (an int64 array or UTF-8 text), every field checked on arrival.

    envelope: magic "CXFD" | u8 version | u8 kind | u16 reserved | i64 a | i64 b | i64 c
              | u64 sender | u64 instance

`sender` is the random id of the server or trainer (0 from the dispatcher), `instance` the
dispatcher process's random id (0 from others): a new one means the dispatcher restarted.

(`SLOTS` names the integer slots a, b, c of each kind; `role` is SERVER or TRAINER.)
server → dispatcher: HELLO(role; payload = its data endpoints, text), BEAT(role), BYE(role: hands its
                     leases back)
dispatcher → server: WELCOME(batches per epoch — for a packed plan the stride of its global ids,
                     `book.PACKED_STRIDE`; payload = the plan as JSON text),
                     LEASE(lease id, epoch, batches per epoch; payload = batch number, claim token
                     pairs: the server sends each batch with its token, and only with it),
                     RESET (you were declared dead or are unknown: drop your leases, say HELLO
                     under a new id), FINISHED (every epoch is done),
                     TAKEN(lease id; payload = batch numbers: batches of that lease taken back
                     for a faster server, not to be built: copies would be refused anyway; an
                     older server drops the message as one of a kind it does not know)
trainer → dispatcher: BEAT(sent_ms, wait_permille, role), CLAIM(role; payload = seq, token pairs: the token
                      came with the batch, which proves the trainer received it from its server),
                      DONE(role; payload = seqs), BYE(role)
dispatcher → trainer: SERVERS(finished, silence timeout_ms, the BEAT's sent_ms; payload = endpoints:
                      one page of the live servers', at most MAX_TEXT bytes, the next BEAT the next),
                      GRANTS(payload = seq, token, granted triples),
                      DONE_OK(finished; payload = seqs),
                      RESET (you were declared dead: drop what you were granted and not used)

A server's BEAT carries in its first slot (a trainer's `sent_ms`) how many of its leased batches
it has not yet started + 1 (`encode_unstarted`; 0 = not reported): the dispatcher may take
those back for a faster server. An older dispatcher ignores the slot on a server's BEAT (it
never read it), and a newer one reads an older server's 0 as "not reported".

A trainer's BEAT carries in `wait_permille` the share of its time its training loop spent waiting
for the next batch over its last wait window (see `client.LeasedClient`): 0 = not reported,
1..WAIT_END = the share in permille + 1 (`encode_wait`, `decode_wait`); anything else is refused
on arrival, and so is a server's BEAT that sets it. Compatibility: slot b of a BEAT was unused
(always 0) before, so an older trainer reads as "not reported" to a newer dispatcher and VERSION
stays 1; the other way round is not compatible: an older dispatcher refuses a newer trainer's
BEATs that report a wait (a slot it does not use) and in time declares that trainer dead, so
upgrade the dispatcher before its trainers.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
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
WAIT_END = 1001  # a BEAT's wait_permille: 0 not reported, 1..WAIT_END the share in permille + 1


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
    TAKEN = 23


SERVER_KINDS = frozenset({Kind.HELLO, Kind.BEAT, Kind.BYE})
TRAINER_KINDS = frozenset({Kind.BEAT, Kind.CLAIM, Kind.DONE, Kind.BYE})
TO_SERVER = frozenset({Kind.WELCOME, Kind.LEASE, Kind.RESET, Kind.FINISHED, Kind.TAKEN})
TO_TRAINER = frozenset({Kind.SERVERS, Kind.GRANTS, Kind.DONE_OK, Kind.RESET})
_TEXT = frozenset({Kind.HELLO, Kind.WELCOME, Kind.SERVERS})
_INTS = frozenset({Kind.LEASE, Kind.CLAIM, Kind.DONE, Kind.GRANTS, Kind.DONE_OK, Kind.TAKEN})
_WIDTH = {Kind.LEASE: 2, Kind.CLAIM: 2, Kind.GRANTS: 3}  # int64s per item (others: 1)
_KINDS = {int(k): k for k in Kind}
_RANGES = {"wait_permille": (0, WAIT_END)}  # slots whose values are bounded (checked on arrival)


# What each kind's three integer slots of the envelope mean (unused slots are 0 on the wire).
# `role` is who speaks (a server or a trainer); `sent_ms` a trainer's clock, echoed back to it;
# `wait_permille` a trainer's wait share (see `encode_wait`; a server's BEAT leaves it 0).
SLOTS: dict[Kind, tuple[str | None, str | None, str | None]] = {
    Kind.HELLO: (None, None, "role"),
    Kind.BEAT: ("sent_ms", "wait_permille", "role"),  # a server's: ("unstarted", 0, role)
    Kind.BYE: (None, None, "role"),
    Kind.CLAIM: (None, None, "role"),
    Kind.DONE: (None, None, "role"),
    Kind.WELCOME: ("batches", None, None),
    Kind.LEASE: ("lease", "epoch", "batches"),
    Kind.RESET: (None, None, None),
    Kind.FINISHED: (None, None, None),
    Kind.SERVERS: ("finished", "timeout_ms", "sent_ms"),
    Kind.GRANTS: (None, None, None),
    Kind.DONE_OK: ("finished", None, None),
    Kind.TAKEN: ("lease", None, None),
}


@dataclasses.dataclass(frozen=True)
class Message:
    """One message, its slots by name (see `SLOTS`: which kind uses which)."""

    kind: Kind
    role: int = 0
    sent_ms: int = 0
    batches: int = 0
    lease: int = 0
    epoch: int = 0
    finished: int = 0
    timeout_ms: int = 0
    wait_permille: int = 0
    sender: int = 0
    instance: int = 0
    payload: Any = None  # np.ndarray[int64] for integer kinds, str for text kinds, else None


def pack(kind: Kind, *, sender: int = 0, instance: int = 0, payload=None, **slots: int) -> list:
    """The frames of a ``kind`` message; ``slots`` by name, those `SLOTS` gives ``kind`` (a
    server's BEAT names its first slot ``unstarted``, see `encode_unstarted`)."""
    if kind is Kind.BEAT and "unstarted" in slots:
        slots = {("sent_ms" if k == "unstarted" else k): v for k, v in slots.items()}
    names = SLOTS[kind]
    unknown = sorted(set(slots) - set(names))
    if unknown:
        raise TypeError(f"{kind.name} carries {[n for n in names if n]}, not {unknown}")
    a, b, c = (int(slots.get(n, 0)) if n else 0 for n in names)
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
    names = SLOTS[k]
    if any(v and not n for n, v in zip(names, (a, b, c))):
        raise WireError(f"{k.name} sets a slot it does not use (it carries {[n for n in names if n]})")
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
    named = {n: v for n, v in zip(names, (a, b, c)) if n}
    for n, (low, high) in _RANGES.items():
        if n in named and not low <= named[n] <= high:
            raise WireError(f"{k.name} {n} is {named[n]}, outside {low}..{high}")
    return Message(k, sender=sender, instance=instance, payload=payload, **named)


def encode_wait(ratio: float | None) -> int:
    """A BEAT's `wait_permille` for a wait share in [0, 1] (clamped), or 0 for None or NaN (not reported)."""
    if ratio is None or math.isnan(ratio):
        return 0
    return int(round(min(max(ratio, 0.0), 1.0) * 1000)) + 1


def decode_wait(value: int) -> float | None:
    """The wait share a checked `wait_permille` says, in [0, 1]; None when not reported (0)."""
    return None if value == 0 else (value - 1) / 1000


def encode_unstarted(n: int) -> int:
    """A server's BEAT's first slot (`sent_ms` on a trainer's): its leased batches not yet started + 1
    (0: not reported, an older server)."""
    return max(int(n), 0) + 1


def decode_unstarted(value: int) -> int | None:
    """The unstarted batches a server's BEAT reports (None: not reported; a negative value is refused
    on arrival by the dispatcher as a malformed message)."""
    if value < 0:
        raise WireError(f"a server's BEAT reports {value - 1} unstarted batches")
    return None if value == 0 else value - 1


MAX_ENDPOINTS = 8  # data endpoints one server may announce
MAX_ENDPOINT = 256  # bytes of one endpoint
# tcp://HOST:PORT, HOST a DNS name, an IPv4 address or a bracketed IPv6 one; PORT 1..65535, digits only
_TCP = re.compile(r"tcp://(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})")
_IPC = re.compile(r"ipc://[^\s\x00-\x1f\x7f]+")


def endpoints(text: str) -> list[str]:
    """The data endpoints a server announces: 1..MAX_ENDPOINTS distinct tcp://HOST:PORT or
    ipc://PATH addresses, space separated, each at most MAX_ENDPOINT bytes."""
    out = text.split(" ")
    if not 1 <= len(out) <= MAX_ENDPOINTS:
        raise WireError(f"a server announces 1..{MAX_ENDPOINTS} endpoints, got {len(out)}")
    if len(set(out)) != len(out):
        raise WireError(f"a server announces the same endpoint twice: {text[:160]!r}")
    for a in out:
        if len(a.encode()) > MAX_ENDPOINT:
            raise WireError(f"endpoint {a[:80]!r}... is longer than {MAX_ENDPOINT} bytes")
        tcp = _TCP.fullmatch(a)
        if not ((_IPC.fullmatch(a) and a.isprintable()) or (tcp and 1 <= int(tcp.group(1)) <= 65535)):
            raise WireError(f"bad endpoint {a[:80]!r} (expected tcp://HOST:PORT, PORT 1..65535, or ipc://PATH)")
    return out
