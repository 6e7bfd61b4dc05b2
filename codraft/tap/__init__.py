"""The tap wire format `codraft.tap.v1`, schema 2 (docs/architecture.md, Contracts), shared by the
ZeroMQ stream and recorded tap files: one message definition, `encode`/`decode`, and the file format
around it. Schema 2: the last hidden state is the target's final hidden state after the final norm;
schema-1 data (before the final norm) is refused."""

from codraft.tap.fingerprint import FINGERPRINT_FIELDS, model_fingerprint
from codraft.tap.message import (
    DEFAULT_LIMITS,
    DTYPES,
    MAGIC,
    MODES,
    NUM_FRAMES,
    REASONS,
    RETIRED_SCHEMAS,
    SCHEMA_VERSION,
    TapExpectation,
    TapHeader,
    TapLimits,
    TapMessage,
    TapRejected,
    decode,
    encode,
)
from codraft.tap.recording import (
    FILE_MAGIC,
    ReadStats,
    TapDataset,
    TapFileError,
    TapPosition,
    TapWriter,
    list_tap_files,
    read_taps,
)

__all__ = [
    "FINGERPRINT_FIELDS",
    "DEFAULT_LIMITS",
    "DTYPES",
    "FILE_MAGIC",
    "MAGIC",
    "MODES",
    "NUM_FRAMES",
    "REASONS",
    "RETIRED_SCHEMAS",
    "SCHEMA_VERSION",
    "ReadStats",
    "TapDataset",
    "TapExpectation",
    "TapFileError",
    "TapHeader",
    "TapLimits",
    "TapMessage",
    "TapPosition",
    "TapRejected",
    "TapWriter",
    "decode",
    "encode",
    "list_tap_files",
    "model_fingerprint",
    "read_taps",
]
