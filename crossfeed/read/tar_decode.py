"""Stage 3 for tar shards: `Frames` whose payloads are tar samples (``{extension: view}``, from
the frame reader) → one batch. Only how one sample is parsed differs from TFRecords: images are
decoded, collated and recycled by `RecordDecoder`'s own path (JPEGs of one size straight into
their batch rows by libjpeg-turbo)."""

from __future__ import annotations

from collections.abc import Callable

from crossfeed.format import tar
from crossfeed.read.decode import RecordDecoder


class TarDecoder(RecordDecoder):
    """Parses each tar sample's members into its features (`crossfeed.format.tar.sample_values`)."""

    def parse(self, payload, where: Callable[[], str]) -> dict:
        return tar.sample_values(payload, self.features, decode_images=False, where=where)
