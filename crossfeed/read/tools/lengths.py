"""Length percentiles of a token dataset's documents (``crossfeed info``): exact, from the lengths
files beside the shards (`crossfeed.format.lengths`: 4 bytes a record, read whole, checked against
the manifest's sha256), or — without them, or past `EXACT_RECORDS` — bounds from the manifest's
power-of-two length histogram (each percentile's bucket, ``lo-hi``)."""

from __future__ import annotations

import numpy as np

from crossfeed.format.lengths import DTYPE, checked_lengths, lengths_path

PERCENTILES = (50, 90, 99)
EXACT_RECORDS = 50_000_000  # past this many records a split's lengths are not read (200 MB a feature)


def length_percentiles(split, feature: str) -> dict | None:
    """``{"p50": …, "p90": …, "p99": …, "max": …, "exact": bool}`` of ``feature``'s per-record
    lengths in ``split`` (a `crossfeed.read.sources.dataset.Split`); exact values are ints, bounds
    strings ``"lo-hi"``. None when neither the lengths files nor the statistics have them."""
    ds = split.dataset
    names = list(ds.manifest.lengths or ())
    shards = split.info.shards
    if feature in names and shards and all(getattr(s, "lengths_sha256", None) for s in shards):
        if sum(s.num_records for s in shards) <= EXACT_RECORDS:
            col, width = names.index(feature), len(names)
            parts = []
            for info in shards:
                rel = lengths_path(info.file)
                data = ds.index_storage.read(rel, limit=info.num_records * width * DTYPE.itemsize + 1)
                parts.append(checked_lengths(data, ds.index_storage.url(rel), info, width)[:, col])
            lengths = np.concatenate(parts)
            if lengths.size:
                p = np.percentile(lengths, PERCENTILES, method="inverted_cdf")
                out = {f"p{q}": int(v) for q, v in zip(PERCENTILES, p)}
                return {**out, "max": int(lengths.max()), "exact": True}
    stats = ((split.info.statistics or {}).get(feature) or {}).get("lengths")
    if not isinstance(stats, dict) or not stats.get("histogram") or not stats.get("count"):
        return None
    buckets = list(stats["histogram"].items())  # in order: "0", "1", "2-3", "4-7" …
    counts = np.cumsum([n for _, n in buckets])
    out = {}
    for q in PERCENTILES:
        b = int(np.searchsorted(counts, q / 100 * counts[-1]))
        out[f"p{q}"] = buckets[min(b, len(buckets) - 1)][0]
    return {**out, "max": int(stats["max"]), "exact": False}


def percentiles_line(p: dict) -> str:
    """``lengths p50 412  p90 1,530  p99 3,980  max 8,190`` (``≈`` and buckets when not exact)."""
    show = (lambda v: f"{v:,}") if p["exact"] else (lambda v: str(v))
    head = "length percentiles" if p["exact"] else "length percentiles (≈, power-of-two buckets)"
    parts = [f"p{q} {show(p[f'p{q}'])}" for q in PERCENTILES]
    return f"{head}: {'  '.join(parts)}  max {p['max']:,}"
