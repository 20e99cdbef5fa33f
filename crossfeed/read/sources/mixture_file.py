"""A mixture written down: a JSON file naming a mixture's sources, for the command line
(``crossfeed serve mix.json ADDRESS``) where a Python list of `Source` cannot be passed::

    {"sources": [{"path": "web/", "split": "train", "weight": 3},
                 {"path": "photos-wds/", "rename": {"jpg": "image", "cls": "label"}},
                 {"path": "books/", "weight": 1, "features": ["image", "label"]}],
     "samples_per_epoch": 1000000}

Relative paths are relative to the file's folder; ``split`` defaults to ``train``, ``weight`` to
1 (or a schedule: ``{"constant": [[0, 3], [900000, 1]]}``, ``{"linear": [[0, 1], [900000, 3]],
"every": 10000}``, in samples: `crossfeed.read.schedule`), ``rename`` and ``features`` are `Source`'s, and ``samples_per_epoch`` to the sum of the sources' sizes (`crossfeed.read.stages.sampler.MixtureOrder`).
"""

from __future__ import annotations

import json
import os

from crossfeed.errors import ConfigError
from crossfeed.read.options import Source
from crossfeed.read.schedule import Schedule

_KEYS = {"sources", "samples_per_epoch"}
_SOURCE_KEYS = {"path", "split", "weight", "rename", "features"}


def is_mixture_spec(path) -> bool:
    """Whether ``path`` names a mixture spec file (a ``.json`` file, not a dataset folder)."""
    return isinstance(path, (str, os.PathLike)) and str(path).endswith(".json") and os.path.isfile(path)


def load_mixture_spec(path) -> tuple[list[Source], int | None]:
    """``(sources, samples_per_epoch)`` from the spec file at ``path``; a bad file raises
    `ConfigError` naming it and what is wrong."""
    try:
        with open(path) as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the mixture spec ({e})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("sources"), list) or not spec["sources"]:
        raise ConfigError(f'{path}: a mixture spec is {{"sources": [{{"path": ..., "weight": ...}}, ...]}}')
    if set(spec) - _KEYS:
        raise ConfigError(f"{path}: unknown keys {sorted(set(spec) - _KEYS)}; it may have {sorted(_KEYS)}")
    base = os.path.dirname(os.path.abspath(path))
    sources = []
    for i, s in enumerate(spec["sources"]):
        if not isinstance(s, dict) or "path" not in s or set(s) - _SOURCE_KEYS:
            raise ConfigError(
                f"{path}: source {i} must be an object with 'path' and optionally {sorted(_SOURCE_KEYS - {'path'})}"
            )
        p = str(s["path"])
        if "://" not in p and not os.path.isabs(p):
            p = os.path.join(base, p)
        try:
            sources.append(Source.from_json({**s, "path": p}))
        except ConfigError as e:
            raise ConfigError(f"{path}: source {i}: {e}") from None
    n = spec.get("samples_per_epoch")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ConfigError(f"{path}: samples_per_epoch must be a positive integer, got {n!r}")
    from crossfeed.read.stages.sampler import integer_weights, mixture_phases

    try:  # the weights as the plan takes them (integers, phases): a problem names this file
        if any(isinstance(s.weight, Schedule) for s in sources):
            mixture_phases([s.weight for s in sources])
        elif len(sources) > 1:
            integer_weights([s.weight for s in sources])
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return sources, n
