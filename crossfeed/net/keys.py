"""CURVE keys: writing key pairs, loading them, and the server-side allowlist.

Files follow pyzmq's certificate format (`zmq.auth.create_certificates`): `NAME.key` holds the
public key, `NAME.key_secret` both keys. A server directory holds `server.key_secret` and the
public `*.key` files of the clients it accepts; a client directory holds `client.key_secret`
and the server's public `server.key`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from crossfeed.errors import ConfigError

logger = logging.getLogger(__name__)


def keygen(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write a fresh key pair `DIR/NAME.key` (public) and `DIR/NAME.key_secret` (0600)."""
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support")
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name {name!r} must be a plain file name")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (d / f"{name}{suffix}").exists():
            raise ConfigError(f"{d / (name + suffix)} exists; choose another name or remove it")
    public_key, secret_key = zmq.curve_keypair()
    public, secret = d / f"{name}.key", d / f"{name}.key_secret"
    # The secret file is created 0600 (never readable by others, not even for a moment); O_EXCL
    # refuses a file that appeared since the check above, or a planted symlink.
    _write_key_file(secret, public_key, secret_key, 0o600)
    _write_key_file(public, public_key, None, 0o644)
    return public, secret


def _write_key_file(path: Path, public: bytes, secret: bytes | None, mode: int) -> None:
    """A key file in pyzmq's certificate format (what `zmq.auth.load_certificate` reads)."""
    lines = [
        "#   ZeroMQ CURVE " + ("Secret" if secret else "Public") + " Certificate (crossfeed keygen)",
        "#   " + ("Keep this file private; never share it." if secret else "Exchange securely, or upload."),
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    except FileExistsError as e:
        raise ConfigError(f"{path} exists; choose another name or remove it") from e
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def check_not_writable_by_others(path: Path, what: str) -> None:
    """Refuse a key directory or file that group or other users may write: anyone who can add a
    ``*.key`` there could let their own client in."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from e
    if mode & 0o022:
        raise ConfigError(
            f"{what} {path} is writable by {'group and others' if mode & 0o022 == 0o022 else 'group' if mode & 0o020 else 'others'} "
            f"(mode {mode & 0o7777:04o}): anyone who can write there can add a client key; run `chmod go-w {path}`"
        )


def _load(path: Path, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read CURVE key file {path}: {e}") from e
    if need_secret and not secret:
        raise ConfigError(f"{path} holds no secret key; pass the .key_secret file")
    return public, secret


@dataclasses.dataclass(frozen=True)
class ServerKeys:
    """The server's key pair and the public keys of the clients it accepts."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]

    @classmethod
    def from_dir(cls, directory: str | os.PathLike, server_key: str | os.PathLike | None = None):
        d = Path(directory)
        if not d.is_dir():
            raise ConfigError(f"--auth-keys {d}: not a directory")
        check_not_writable_by_others(d, "--auth-keys directory")
        secret_path = Path(server_key) if server_key else d / "server.key_secret"
        check_not_writable_by_others(secret_path, "server key file")
        public, secret = _load(secret_path, True)
        keys = sorted(d.glob("*.key"))
        for p in keys:
            check_not_writable_by_others(p, "client key file")
        allowed = frozenset(k for p in keys if (k := _load(p, False)[0]) != public)
        if not allowed:
            raise ConfigError(f"{d} holds no client public keys (*.key); run `crossfeed keygen`")
        return cls(public, secret, allowed)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class ClientKeys:
    """A client's key pair and the public key of the server it trusts."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike, server_public_file: str | os.PathLike):
        public, secret = _load(Path(secret_file), True)
        server_public, _ = _load(Path(server_public_file), False)
        return cls(public, secret, server_public)  # type: ignore[arg-type]

    @classmethod
    def from_dir(cls, directory: str | os.PathLike, name: str = "client"):
        d = Path(directory)
        return cls.from_files(d / f"{name}.key_secret", d / "server.key")


def as_client_keys(keys: ClientKeys | str | os.PathLike | None) -> ClientKeys | None:
    if keys is None or isinstance(keys, ClientKeys):
        return keys
    return ClientKeys.from_dir(keys)


class _Allowlist:
    def __init__(self, allowed: frozenset[bytes]):
        self._allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self._allowed
        if not ok:
            logger.warning("refused a client with an unknown CURVE key %s", key.decode(errors="replace"))
        return ok


def start_authenticator(ctx: zmq.Context, keys: ServerKeys) -> ThreadAuthenticator:
    """A running ZAP handler on `ctx` that accepts only `keys.allowed`; stop() it when done."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_Allowlist(keys.allowed))
    return auth


def secure_server_socket(sock: zmq.Socket, keys: ServerKeys | None) -> None:
    if keys is not None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True


def secure_client_socket(sock: zmq.Socket, keys: ClientKeys | None) -> None:
    if keys is not None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = keys.server_public
