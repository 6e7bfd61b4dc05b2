"""Learner data path: tap messages -> samples -> packed THD batches."""

from codraft.learner.data.packing import (
    PackedBatch,
    Packer,
    PackerStats,
    Sample,
    pack,
    pack_stream,
    padded_len,
    unpack,
)

__all__ = [
    "PackedBatch",
    "Packer",
    "PackerStats",
    "Sample",
    "pack",
    "pack_stream",
    "padded_len",
    "unpack",
]
