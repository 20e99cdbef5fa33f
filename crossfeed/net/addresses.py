"""Addresses: shell-style brace expansion and validation of ZeroMQ endpoints.

expand("tcp://127.0.0.1:78{80..83}") -> ["tcp://127.0.0.1:7880", ..., "tcp://127.0.0.1:7883"]
expand("ipc:///tmp/{a,b}.sock")     -> ["ipc:///tmp/a.sock", "ipc:///tmp/b.sock"]
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from crossfeed.errors import ConfigError

# scheme -> what it is; the one table of transports we accept
SCHEMES = {
    "tcp": "TCP, host:port (port 0 or * binds to a free port)",
    "ipc": "a Unix domain socket path",
    "inproc": "in-process (same zmq context only; used by tests)",
}
MAX_EXPANSION = 4096
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def _alternatives(body: str, text: str) -> list[str]:
    m = _RANGE.match(body)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        width = len(m.group(1)) if m.group(1).startswith("0") and len(m.group(1)) > 1 else 0
        if abs(hi - lo) >= MAX_EXPANSION:
            raise ConfigError(f"{text!r}: range {{{body}}} is longer than {MAX_EXPANSION}")
        step = 1 if hi >= lo else -1
        return [str(i).zfill(width) for i in range(lo, hi + step, step)]
    if "," in body:
        return body.split(",")
    return ["{" + body + "}"]  # not a brace pattern (shell leaves it alone too)


def expand(text: str) -> list[str]:
    """All strings that the brace pattern `text` names, in order."""
    m = _BRACE.search(text)
    if m is None:
        return [text]
    head, tail = text[: m.start()], text[m.end() :]
    out: list[str] = []
    alternatives = _alternatives(m.group(1), text)
    if alternatives == ["{" + m.group(1) + "}"]:
        return [head + alternatives[0] + rest for rest in expand(tail)]
    for alt in alternatives:
        out.extend(expand(head + alt + tail))
        if len(out) > MAX_EXPANSION:
            raise ConfigError(f"{text!r} expands to more than {MAX_EXPANSION} addresses")
    return out


def validate(address: str) -> str:
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in SCHEMES or not rest:
        known = ", ".join(f"{k}:// ({v})" for k, v in SCHEMES.items())
        raise ConfigError(f"address {address!r} is not a ZeroMQ endpoint; use one of {known}")
    if scheme == "tcp" and ":" not in rest:
        raise ConfigError(f"address {address!r} needs a port, e.g. tcp://127.0.0.1:7880")
    return address


def expand_all(addresses: str | Iterable[str]) -> list[str]:
    """Expanded, validated endpoints; a single string may hold several separated by spaces."""
    items = addresses.split() if isinstance(addresses, str) else list(addresses)
    out = [validate(a) for item in items for a in expand(item)]
    if not out:
        raise ConfigError("no address given")
    return out


def is_local(address: str) -> bool:
    """True when only this machine can reach `address`: ipc://, inproc://, or tcp on a loopback
    host (127.0.0.0/8, ::1, localhost). Wildcards (`*`, 0.0.0.0), interface names and every
    other host are not local."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
