"""Input data: the shards' I/O (``shards``), image decoding (``images``), the synthetic embedded data
(``synthetic``) and the real datasets' converters (``convert``). The names below are the package's API."""

from pipeline.data.images import BadInput, decode_image, encode_image, sample_images
from pipeline.data.shards import (
    EMBEDDED_SIZES,
    SUCCESS_MARKER,
    DataError,
    iter_input_rows,
    mark_complete,
    read_input,
    synthetic_records,
    write_shard,
    write_shards,
    write_synthetic,
    write_synthetic_shards,
)

__all__ = [
    "BadInput", "DataError", "EMBEDDED_SIZES", "SUCCESS_MARKER", "decode_image", "encode_image", "sample_images",
    "iter_input_rows", "mark_complete", "read_input", "synthetic_records", "write_shard", "write_shards",
    "write_synthetic", "write_synthetic_shards",
]
