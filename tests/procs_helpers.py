"""Transforms for the process-executor tests: module-level, so worker processes import them."""

from __future__ import annotations

import numpy as np

FAIL_LABEL = 13  # with batch_size 4 and no shuffle: batch 3


def flip_and_scale(sample: dict) -> dict:
    """A per-sample Python transform: the image flipped, a float derived from the label."""
    out = dict(sample)
    out["image"] = np.ascontiguousarray(sample["image"][:, ::-1])
    out["scaled"] = np.float32(int(sample["label"]) * 0.5)
    return out


def fail_at_label(sample: dict) -> dict:
    if int(sample["label"]) == FAIL_LABEL:
        raise ValueError(f"transform refuses label {FAIL_LABEL}")
    return sample


def add_one(batch: dict) -> dict:
    return {**batch, "label": batch["label"] + 1}
