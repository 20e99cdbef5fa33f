"""Hugging Face ``datasets`` folders, recognised by their file names so that they are named as
what they are instead of failing as TFRecord shards: what `save_to_disk` writes (a `Dataset`:
``data-SSSSS-of-NNNNN.arrow`` Arrow IPC stream files with ``dataset_info.json`` and
``state.json``; a `DatasetDict`: ``dataset_dict.json`` and a folder per split) and the cache's
Arrow files (``<name>-<split>.arrow`` beside ``dataset_info.json``).

crossfeed does not read Arrow IPC files in place; it reads Parquet in place
(`crossfeed index`), which ``datasets`` writes with ``to_parquet``. `advice` says so, with the
lines to run.
"""

from __future__ import annotations

from collections.abc import Iterable

DATASET_DICT = "dataset_dict.json"
STATE = "state.json"
INFO = "dataset_info.json"


def kind(names: Iterable[str]) -> str | None:
    """``"dataset_dict"``, ``"dataset"`` (a `save_to_disk` folder), ``"arrow"`` (Arrow files
    beside a ``dataset_info.json``: the cache's), or None, from a folder's file names."""
    names = set(names)
    if DATASET_DICT in names:
        return "dataset_dict"
    arrow = any(n.endswith(".arrow") for n in names)
    if arrow and STATE in names:
        return "dataset"
    if arrow and INFO in names:
        return "arrow"
    return None


def advice(root: str, found: str) -> str:
    """One message: what ``root`` is and how to make crossfeed read it."""
    what = {
        "dataset_dict": "a Hugging Face `datasets` DatasetDict saved with save_to_disk",
        "dataset": "a Hugging Face `datasets` Dataset saved with save_to_disk",
        "arrow": "a Hugging Face `datasets` cache folder",
    }[found]
    if found == "dataset_dict":
        how = (
            f"`d = datasets.load_from_disk({root!r}); [d[s].to_parquet(f'OUT/{{s}}-00000-of-00001.parquet') "
            f"for s in d]`"
        )
    elif found == "dataset":
        how = f"`datasets.load_from_disk({root!r}).to_parquet('OUT/train-00000-of-00001.parquet')`"
    else:
        how = "`datasets.load_dataset(...)[split].to_parquet('OUT/<split>-00000-of-00001.parquet')`"
    return (
        f"{root}: {what} (Arrow IPC files), which crossfeed does not read in place; write it as Parquet, "
        f"which it does: {how}, then `crossfeed index OUT` (typed columns, token lists and images as bytes "
        f"are kept; docs/adopt.md)"
    )
