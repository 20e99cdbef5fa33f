"""What users type, parsed once for every front end: sizes (``"50GB"``, ``"1.5GiB"``, ``512M``)
and ``"module:function"`` references. Every option that takes one goes through here, so a value
accepted by one command is accepted by all (layer 0: imports only `crossfeed.errors`).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from crossfeed.errors import ConfigError

# K, M, G, T are powers of 1024 whichever way they are written (k, KB, KiB); no suffix or B: bytes
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*([kmgt]?)(i?b)?\s*", re.IGNORECASE)


def parse_size(value, what: str = "size", *, zero: bool = False) -> int:
    """Bytes from a positive int or a string such as ``"50GB"``, ``"512M"``, ``"1.5GiB"``,
    ``"4096"`` (K, M, G, T: powers of 1024). ``what`` names the option in the error. ``zero``:
    0 is accepted too (the options where 0 means "no byte limit")."""
    lo = 0 if zero else 1
    if isinstance(value, float) and value.is_integer():  # 1e9 reads as a byte count
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)) and not hasattr(value, "__index__"):
        raise ConfigError(f"{what} must be a size such as '50GB' or a byte count, got {value!r}")
    if not isinstance(value, str):
        value = int(value.__index__())
        if value < lo:
            raise ConfigError(f"{what} must be {'>= 0' if zero else 'positive'}, got {value}")
        return value
    m = _SIZE.fullmatch(value)
    if not m:
        raise ConfigError(f"{what} {value!r} is not a size such as '50GB', '1.5GiB', '512M' or a byte count")
    n = int(float(m[1]) * 1024 ** _UNITS[m[2].lower()])
    if n < lo or (n == 0 and float(m[1]) != 0):
        raise ConfigError(f"{what} must be at least one byte, got {value!r}")
    return n


def resolve_callable(spec: str, *, option: str = "transform", search_cwd: bool = False) -> Callable:
    """``"package.module:function"`` → the function (the form a worker process can import too).
    ``search_cwd``: modules in the current directory are found, as with ``python -m`` (the CLI)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{option} {spec!r}: expected 'module:function', e.g. 'mypkg.aug:augment'")
    if search_cwd and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"{option} {spec!r}: cannot import {module_name} ({e}); run from the folder holding "
            f"{module_name.split('.')[0]}.py or add that folder to PYTHONPATH"
        ) from e
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"{option} {spec!r}: {module_name} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"{option} {spec!r} is not callable")
    return fn
