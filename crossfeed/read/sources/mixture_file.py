"""A mixture written down: a JSON file naming a mixture's sources, for the command line
(``crossfeed serve mix.json ADDRESS``) where a Python list of `Source` cannot be passed::

    {"sources": [{"path": "web/", "split": "train", "weight": 3},
                 {"path": "photos-wds/", "rename": {"jpg": "image", "cls": "label"}},
                 {"path": "books/", "weight": 1, "features": ["image", "label"]}],
     "samples_per_epoch": 1000000}

Relative paths are relative to the file's folder; ``split`` defaults to ``train``, ``weight`` to
1 (or a schedule: ``{"constant": [[0, 3], [900000, 1]]}``, ``{"linear": [[0, 1], [900000, 3]],
"every": 10000}``, in samples: `crossfeed.read.schedule`), ``rename`` and ``features`` are `Source`'s, and ``samples_per_epoch`` to the sum of the sources' sizes (`crossfeed.read.stages.sampler.MixtureOrder`).

A source may be a nested mixture, weighted as one: ``{"mixture": [{"path": ...}, ...], "weight": 2}``,
or ``{"path": "other-mix.json", "weight": 2}`` (`crossfeed.read.sources.nested`; at most
`crossfeed.read.sources.nested.MAX_DEPTH` levels and ``MAX_LEAVES`` sources).
"""

from __future__ import annotations

from crossfeed.errors import ConfigError
from crossfeed.read.options import Source
from crossfeed.read.schedule import Schedule
from crossfeed.read.sources.nested import flatten, is_mixture_spec, read_spec_file

__all__ = ["is_mixture_spec", "load_mixture_spec", "source_of"]


def load_mixture_spec(path) -> tuple[list[Source], int | None]:
    """``(sources, samples_per_epoch)`` from the spec file at ``path``, nested mixtures flattened
    into their leaves (`crossfeed.read.sources.nested`); a bad file raises `ConfigError` naming it
    and what is wrong."""
    sources, n = read_spec_file(path)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ConfigError(f"{path}: samples_per_epoch must be a positive integer, got {n!r}")
    from crossfeed.read.stages.sampler import integer_weights, mixture_phases

    sources = list(flatten(sources))
    try:  # the weights as the plan takes them (integers, phases): a problem names this file
        if any(isinstance(s.weight, Schedule) for s in sources):
            mixture_phases([s.weight for s in sources])
        elif len(sources) > 1:
            integer_weights([s.weight for s in sources])
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return sources, n


def source_of(dataset) -> tuple[object, dict]:
    """What a Loader reads for ``dataset`` — a mixture spec file's sources, or the dataset itself —
    and the options the file sets (its ``samples_per_epoch``, when it gives one)."""
    if isinstance(dataset, str) and is_mixture_spec(dataset):
        sources, n = load_mixture_spec(dataset)
        return sources, ({"samples_per_epoch": n} if n is not None else {})
    return dataset, {}
